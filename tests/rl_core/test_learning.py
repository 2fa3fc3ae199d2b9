"""The whole loop on CPU: rollout driver → queue → trainer → weight sync, with the tiny model.

The loop's bookkeeping (batches, stale drops, stop, checkpoints, resume) is tested
with a stand-in trainer first; then the real thing: a torch-engine subprocess, the
real PPO trainer, and the toy task (``rl_core.toy``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rl_core.checkpoints import LOOP_STATE, latest_checkpoint
from rl_core.config import RunConfig
from rl_core.inference import InferenceClient
from rl_core.loop import ListReporter, QueueSource, TrainingLoop
from rl_core.staleness import StalenessController
from rl_core.toy import TOY_SETTINGS, toy_rows
from rl_core.types import Trajectory

# --------------------------------------------------------------------------- helpers

# The toy task with a rank-8 adapter: adapters want a larger learning rate than full
# fine-tuning (they start at zero and have few parameters). Measured: mean reward 0.006
# at step 1, 0.68 at step 6, 0.75 from step 7 on (~1 s a step on 2 shared CPU cores).
LORA_TOY = {"lora_rank": 8, "lora_alpha": 16.0, "learning_rate": 2e-2, "max_steps": 10}


def _cfg(model: str | Path = "unused", **overrides: Any) -> RunConfig:
    return RunConfig.from_dict({"base_model": str(model), **TOY_SETTINGS, **overrides})


def _traj(version: int, n_generated: int = 2, reward: float = 1.0, group: str = "") -> Trajectory:
    ids = [1, 2, 3] + [4] * n_generated
    mask = [0, 0, 0] + [1] * n_generated
    return Trajectory(
        ids, mask, [0.0] * len(ids), [-1 if not m else version for m in mask], [reward], group
    )


class FakeTrainer:
    """Counts steps and writes marker files: the loop's bookkeeping without torch."""

    def __init__(self) -> None:
        self.version = 0
        self.batches: list[tuple[int, list[Trajectory]]] = []

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        self.batches.append((self.version, list(trajectories)))
        self.version += 1
        return {"rollout/reward": 0.5, "version": float(self.version)}

    def save_weights(self, path: str) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        return path

    def save_checkpoint(self, path: str) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "state.json").write_text(json.dumps({"version": self.version}))
        return path

    def load_checkpoint(self, path: str) -> None:
        self.version = json.loads((Path(path) / "state.json").read_text())["version"]


class StopAt(ListReporter):
    """Calls ``stop`` once step ``k`` has been reported."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.target: Any = None

    async def metrics(self, step: int, version: int, values: dict[str, float]) -> None:
        await super().metrics(step, version, values)
        if step == self.k and self.target is not None:
            self.target.stop()


# --------------------------------------------------------------------------- the loop alone


async def test_loop_trains_full_batches_and_reports_each_step(tmp_path):
    cfg = _cfg(batch_size=4, group_size=2, save_every=2, max_staleness=8)
    source, reporter, trainer = QueueSource(), ListReporter(), FakeTrainer()
    for i in range(12):
        await source.put(f"k{i}", _traj(0))
    loop = TrainingLoop(cfg, trainer, source, None, reporter, None, tmp_path / "ckpt")
    summary = await loop.run(max_steps=3)

    assert (summary.step, summary.version, summary.stopped) == (3, 3, False)
    assert [len(batch) for _, batch in trainer.batches] == [4, 4, 4]
    assert [step for step, _, _ in reporter.metrics_log] == [1, 2, 3]
    assert reporter.versions == [1, 2, 3]
    assert source.trained == 12
    # Every save_every steps and at the end.
    assert [c["step"] for c in reporter.checkpoints] == [2, 3]
    assert all(c["size_bytes"] > 0 for c in reporter.checkpoints)
    values = reporter.metrics_log[-1][2]
    for key in ("timing/wait_batch", "timing/train_step", "timing/step", "perf/trajectories_per_s"):
        assert key in values, key
    assert reporter.events[-1][0] == "completed"


async def test_loop_drops_stale_trajectories_and_refills_the_batch(tmp_path):
    cfg = _cfg(batch_size=2, group_size=1, max_staleness=1)
    controller = StalenessController(1, 2)
    trainer = FakeTrainer()
    trainer.version = 3
    controller.on_version(3)

    class Recording(QueueSource):
        dropped_keys: list[str] = []

        async def finished(self, trained, dropped, version):
            self.dropped_keys += dropped
            await super().finished(trained, dropped, version)

    source = Recording()
    for key, version in [("old", 1), ("ok1", 2), ("older", 0), ("ok2", 3)]:
        assert controller.try_admit()
        await source.put(key, _traj(version))
        controller.on_finish(True)
    loop = TrainingLoop(cfg, trainer, source, None, ListReporter(), controller)
    await asyncio.wait_for(loop.run(max_steps=1), 10)

    assert source.dropped_keys == ["old", "older"]
    ((train_version, batch),) = trainer.batches
    assert train_version == 3 and [t.oldest_version for t in batch] == [2, 3]
    assert controller.dropped == 2  # their admission slots were given back


async def test_stop_while_waiting_for_a_batch_ends_with_a_final_checkpoint(tmp_path):
    cfg = _cfg(batch_size=2, group_size=1, save_every=100)
    source, reporter = QueueSource(), ListReporter()
    for i in range(2):
        await source.put(f"k{i}", _traj(0))
    loop = TrainingLoop(cfg, FakeTrainer(), source, None, reporter, None, tmp_path)
    task = asyncio.create_task(loop.run(max_steps=10))
    while loop.step < 1:
        await asyncio.sleep(0.01)
    loop.stop()
    summary = await asyncio.wait_for(task, 5)

    assert summary.stopped and summary.step == 1
    assert [c["step"] for c in reporter.checkpoints] == [1]
    assert reporter.events[-1][0] == "stopped"
    info = latest_checkpoint(tmp_path)
    assert info is not None and (info.step, info.version) == (1, 1)


class SlowDiskTrainer(FakeTrainer):
    """Copies its state for an asynchronous checkpoint; each write waits for ``disk`` to
    let it through (a slow disk), or fails when ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.disk = threading.Semaphore(0)
        self.fail = False
        self.written: list[int] = []

    def checkpoint_snapshot(self):
        version = self.version  # the copy: what the write will hold, whatever trains meanwhile

        def write(path: str) -> str:
            assert self.disk.acquire(timeout=10), "the test never let the write through"
            if self.fail:
                raise OSError("No space left on device")
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "state.json").write_text(json.dumps({"version": version}))
            self.written.append(version)
            return path

        return write


async def test_training_goes_on_while_a_checkpoint_is_written_and_it_counts_once_complete(
    tmp_path,
):
    cfg = _cfg(batch_size=1, group_size=1, save_every=2, max_staleness=8)
    source, reporter, trainer = QueueSource(), ListReporter(), SlowDiskTrainer()
    for i in range(6):
        await source.put(f"k{i}", _traj(0))
    loop = TrainingLoop(cfg, trainer, source, None, reporter, None, tmp_path)
    task = asyncio.create_task(loop.run(max_steps=4))
    while loop.step < 3:  # step 2's checkpoint is still on its way to the disk
        await asyncio.sleep(0.01)
    assert latest_checkpoint(tmp_path) is None and reporter.checkpoints == []
    trainer.disk.release()  # step 2's write completes
    while not reporter.checkpoints:
        await asyncio.sleep(0.01)
    assert [(c["step"], c["version"]) for c in reporter.checkpoints] == [(2, 2)]
    trainer.disk.release()  # step 4's, the last: the run ends only once it is written
    summary = await asyncio.wait_for(task, 10)

    assert summary.step == 4 and trainer.written == [2, 4]
    assert [(c["step"], c["version"]) for c in reporter.checkpoints] == [(2, 2), (4, 4)]
    info = latest_checkpoint(tmp_path)
    assert info is not None and (info.step, info.version) == (4, 4)
    assert json.loads((info.path / "state.json").read_text()) == {"version": 4}


async def test_a_failed_asynchronous_checkpoint_fails_the_run(tmp_path):
    cfg = _cfg(batch_size=1, group_size=1, save_every=1, max_staleness=8)
    source, reporter, trainer = QueueSource(), ListReporter(), SlowDiskTrainer()
    for i in range(10):
        await source.put(f"k{i}", _traj(0))
    trainer.fail = True
    trainer.disk.release()
    with pytest.raises(OSError, match="No space left"):
        await TrainingLoop(cfg, trainer, source, None, reporter, None, tmp_path).run(max_steps=10)
    assert reporter.checkpoints == [] and latest_checkpoint(tmp_path) is None
    assert reporter.events[-1][0] == "error"


async def test_async_checkpoints_off_saves_in_step(tmp_path):
    cfg = _cfg(batch_size=1, group_size=1, save_every=1, max_staleness=8, async_checkpoints=False)
    source, reporter, trainer = QueueSource(), ListReporter(), SlowDiskTrainer()
    for i in range(2):
        await source.put(f"k{i}", _traj(0))
    await TrainingLoop(cfg, trainer, source, None, reporter, None, tmp_path).run(max_steps=2)
    assert trainer.written == []  # never snapshotted: save_checkpoint wrote each in its step
    assert [c["step"] for c in reporter.checkpoints] == [1, 2]


async def test_a_new_loop_resumes_from_the_latest_checkpoint(tmp_path):
    cfg = _cfg(batch_size=2, group_size=1, save_every=1)
    source = QueueSource()
    for i in range(10):
        await source.put(f"k{i}", _traj(0 if i < 4 else 2))  # fresh enough at versions 2, 3
    await TrainingLoop(cfg, FakeTrainer(), source, None, None, None, tmp_path).run(max_steps=2)
    # A checkpoint without its loop state was interrupted mid-write: never resumed from.
    (tmp_path / "step_000009").mkdir()

    controller = StalenessController(1, 2)
    reporter, trainer = ListReporter(), FakeTrainer()
    loop = TrainingLoop(cfg, trainer, source, None, reporter, controller, tmp_path)
    summary = await loop.run(max_steps=4)

    assert trainer.batches[0][0] == 2  # continued from version 2
    assert [step for step, _, _ in reporter.metrics_log] == [3, 4]
    assert summary.step == 4 and summary.version == 4
    assert ("resumed", "Resumed from step 2 (version 2).") in reporter.events
    # The controller counts the restored batches as trained: capacity is one batch ahead.
    assert controller.stats()["staleness/accepted"] >= 2 * 2
    assert json.loads((tmp_path / "step_000004" / LOOP_STATE).read_text()) == {
        "step": 4,
        "version": 4,
        "counters": {"rejected": 0, "dropped": 0},
    }


async def test_the_staleness_counters_go_on_from_the_checkpoint_after_a_resume(tmp_path):
    # staleness/rejected and staleness/dropped_total are running totals: a resumed run's
    # series continue from the checkpoint's values instead of starting again at 0.
    cfg = _cfg(batch_size=2, group_size=1, save_every=1, max_staleness=0)
    source = QueueSource()
    for key, version in [("a", 0), ("b", 0), ("c", 0), ("d", 1), ("e", 1)]:
        await source.put(key, _traj(version))  # c is too old for version 1
    first = StalenessController(8, 2)
    for accepted in [True] * 5 + [False] * 3:  # three rollouts failed to generate
        assert first.try_admit()
        first.on_finish(accepted)
    reporter = ListReporter()
    await TrainingLoop(cfg, FakeTrainer(), source, None, reporter, first, tmp_path).run(max_steps=2)
    assert reporter.metrics_log[-1][2]["staleness/dropped_total"] == 1

    for key, version in [("f", 0), ("g", 2), ("h", 2)]:
        await source.put(key, _traj(version))  # f is too old for version 2
    second, reporter = StalenessController(8, 2), ListReporter()
    for _ in range(3):
        assert second.try_admit()
        second.on_finish(True)
    await TrainingLoop(cfg, FakeTrainer(), source, None, reporter, second, tmp_path).run(
        max_steps=3
    )
    [(step, _, values)] = reporter.metrics_log
    assert step == 3
    assert (values["staleness/rejected"], values["staleness/dropped_total"]) == (3, 2)


# --------------------------------------------------------------------------- the real thing


@pytest.fixture
def engine(torch_engine_factory):
    """A fresh torch engine at weight version 0 (the loop changes its weights)."""
    return torch_engine_factory(weight_version=0)


def _params(trainer) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _recording_trainer(cfg: RunConfig, model_dir: Path):
    """A real PPOTrainer that remembers each batch with the version it was trained at."""
    from rl_core.trainer import PPOTrainer

    class RecordingTrainer(PPOTrainer):
        trained: list[tuple[int, list[Trajectory]]]

        def train_step(self, trajectories):
            self.trained.append((self.version, list(trajectories)))
            return super().train_step(trajectories)

    trainer = RecordingTrainer(cfg, model_path=model_dir, device="cpu")
    trainer.trained = []
    return trainer


def _local_run(cfg, trainer, engine, tmp_path, rows=None, reporter=None, checkpoint_dir=None):
    from rl_core.rollout import LocalRun

    return LocalRun(
        cfg,
        trainer=trainer,
        urls=[engine.url],
        rows=rows or toy_rows(64, seed=0),
        weights_dir=tmp_path / "weights",
        checkpoint_dir=checkpoint_dir,
        reporter=reporter,
    )


@pytest.mark.slow
async def test_the_tiny_model_learns_the_toy_task(tiny_model_dir, engine, tmp_path):
    import torch

    cfg = _cfg(tiny_model_dir)
    trainer = _recording_trainer(cfg, tiny_model_dir)
    before = _params(trainer)
    reporter = ListReporter()
    summary = await _local_run(cfg, trainer, engine, tmp_path, reporter=reporter).run()

    rewards = reporter.series("rollout/reward")
    steps = TOY_SETTINGS["max_steps"]
    assert summary.step == len(rewards) == steps
    # The first step trains on answers the untrained model sampled (seeded: the same on
    # every machine; later early steps may already mix in answers of updated versions, as
    # fast as generation runs beside training); the last ones on the learned policy's.
    first, last = rewards[0], sum(rewards[-5:]) / 5
    assert first < 0.1, rewards
    assert last > first + 0.5, rewards
    # It trained prefix trees (the default): each group's prompt ran once for its 8 answers.
    computed = reporter.series("perf/computed_tokens_per_token")
    assert cfg.prefix_tree and max(computed) < 0.8, computed
    after = _params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before), "parameters must change"
    # The servers serve the trained weights: they report the trainer's version.
    async with InferenceClient(engine.url) as client:
        info = await client.get_model_info()
    assert int(info["weight_version"]) == trainer.version == steps


async def test_a_lora_adapter_learns_the_toy_task_and_the_base_weights_stay_bit_identical(
    tiny_model_dir, engine, tmp_path
):
    import torch

    cfg = _cfg(tiny_model_dir, **LORA_TOY)
    trainer = _recording_trainer(cfg, tiny_model_dir)
    named = dict(trainer.model.named_parameters())
    before = {k: p.detach().clone() for k, p in named.items()}
    reporter = ListReporter()
    summary = await _local_run(cfg, trainer, engine, tmp_path, reporter=reporter).run()

    rewards = reporter.series("rollout/reward")
    assert summary.step == len(rewards) == cfg.max_steps
    # Step 1's batch is the base model's answers; from step 2 on a batch may hold answers of
    # the updated adapter (how many depends on how fast generation runs beside training).
    first, last = rewards[0], sum(rewards[-3:]) / 3
    assert first < 0.1, rewards
    assert last > first + 0.4, rewards
    for name, p in named.items():
        changed = not torch.equal(before[name], p.detach())
        if p.requires_grad:
            assert ".lora_" in name
        else:
            assert not changed, f"base weight {name} changed"
    assert any(not torch.equal(before[n], p.detach()) for n, p in named.items() if p.requires_grad)


async def test_max_staleness_bounds_every_trained_token_and_pauses_mix_versions(
    tiny_model_dir, engine, tmp_path
):
    cfg = _cfg(tiny_model_dir, max_staleness=2, batch_size=8, group_size=4, max_new_tokens=48)
    trainer = _recording_trainer(cfg, tiny_model_dir)
    async with InferenceClient(engine.url) as client:
        await client.slow_down(0.01)  # keep generations in flight across weight updates
    reporter = ListReporter()
    await _local_run(cfg, trainer, engine, tmp_path, reporter=reporter).run(max_steps=8)

    assert len(trainer.trained) == 8
    lags, mixed = [], 0
    for version, batch in trainer.trained:
        assert len(batch) == 8
        for traj in batch:
            lags.append(version - traj.oldest_version)
            generated = {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m}
            assert max(generated) <= version  # nothing from the future
            mixed += len(generated) > 1
    assert max(lags) <= 2, lags
    assert max(lags) >= 1, "with max_staleness=2 some batches must be generated ahead of training"
    assert mixed > 0, "a weight update should interrupt some in-flight generation"
    assert max(reporter.series("staleness/max")) <= 2


async def test_max_staleness_zero_is_synchronous(tiny_model_dir, engine, tmp_path):
    cfg = _cfg(tiny_model_dir, max_staleness=0, batch_size=8, group_size=4, max_new_tokens=32)
    trainer = _recording_trainer(cfg, tiny_model_dir)
    reporter = ListReporter()
    await _local_run(cfg, trainer, engine, tmp_path, reporter=reporter).run(max_steps=5)

    assert [version for version, _ in trainer.trained] == [0, 1, 2, 3, 4]
    for version, batch in trainer.trained:
        for traj in batch:
            generated = {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m}
            assert generated == {version}, (version, generated)
    # No overlap: when a step is reported nothing is generating and nothing is waiting.
    assert reporter.series("staleness/running") == [0.0] * 5
    assert reporter.series("staleness/dropped") == [0.0] * 5


async def test_a_stopped_run_resumes_from_its_checkpoint_at_the_same_step_and_version(
    tiny_model_dir, engine, tmp_path
):
    import torch

    cfg = _cfg(tiny_model_dir, batch_size=8, group_size=4, save_every=100)
    checkpoints = tmp_path / "checkpoints"
    first_reporter = StopAt(3)
    first_trainer = _recording_trainer(cfg, tiny_model_dir)
    run = _local_run(
        cfg, first_trainer, engine, tmp_path, reporter=first_reporter, checkpoint_dir=checkpoints
    )
    first_reporter.target = run
    summary = await run.run(max_steps=10)
    assert summary.stopped and (summary.step, summary.version) == (3, 3)
    assert [c["step"] for c in first_reporter.checkpoints] == [3]  # the final checkpoint
    trained_weights = _params(first_trainer)

    second_trainer = _recording_trainer(cfg, tiny_model_dir)
    reporter = ListReporter()
    run = _local_run(
        cfg, second_trainer, engine, tmp_path, reporter=reporter, checkpoint_dir=checkpoints
    )
    run.loop.restore()
    assert second_trainer.version == 3 and run.loop.step == 3
    restored = _params(second_trainer)
    assert all(torch.equal(trained_weights[k], restored[k]) for k in restored)
    summary = await run.run(max_steps=5)

    assert [step for step, _, _ in reporter.metrics_log] == [4, 5]
    assert [version for version, _ in second_trainer.trained] == [3, 4]
    assert reporter.versions[0] == 3  # the restored weights were pushed before training
    assert (summary.step, summary.version, summary.stopped) == (5, 5, False)
    # Rollouts for the resumed run came from the restored policy, not the base model.
    assert all(t.oldest_version >= 2 for _, batch in second_trainer.trained for t in batch)
