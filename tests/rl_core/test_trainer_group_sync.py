"""Weight and adapter sync from the trainer as Ray actors (``workers.trainer_group``) into a
real torch-engine server, on a real local Ray (CPU, gloo): one worker, and two FSDP2
workers (every rank gathers each full tensor, rank 0 broadcasts or writes).

After a real train step and a push, the server's logprobs equal those of the trainer's
weights (gathered by ``save_weights``, recomputed by a plain forward pass); a second push
reuses the weight group; a server that dies, or hangs, between updates stops the sync
with a ``WeightSyncError`` within the watchdog time, and the workers still take the next
step (no rank is left in a collective).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.inference.client import InferenceClient
from rl_core.loop import ListReporter
from rl_core.weight_sync import WeightSync, WeightSyncError
from tests.test_trainer_group import _batch, _config, local_ray  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]

PROMPT = [72, 101, 108, 108, 111, 44, 32]
TIMEOUT_S = 10.0  # the watchdog in these tests


def _group(model_dir: Path, workers: int, **overrides: Any) -> Any:
    from workers.trainer_group import TrainerGroup

    overrides.setdefault("learning_rate", 1e-2)  # a step that visibly changes the logprobs
    return TrainerGroup(
        _config(model_dir, train_workers=workers, **overrides),
        bundle={"CPU": 1.0},
        placement_timeout_s=120,
        env={"STEEP_TORCH_THREADS": "1"},
    )


class CountingInit:
    """``group`` with its ``init_weight_group`` calls counted (a second push reuses the group)."""

    def __init__(self, group: Any):
        self.inner, self.inits = group, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def init_weight_group(self, **kwargs: Any) -> None:
        self.inits += 1
        self.inner.init_weight_group(**kwargs)


async def _assert_serves(
    client: InferenceClient,
    reference: Any,
    weights: Path,
    version: int,
    base: Path,
    **extra: Any,
) -> None:
    """Generate greedily: the logprobs are ``weights``'s, not ``base``'s; tokens carry ``version``."""
    result = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0}, **extra)
    assert set(result.versions) == {version}
    got = torch.tensor(result.output_logprobs)
    assert got.numel() == 12
    expected = reference.logprobs(weights, PROMPT, result.output_ids)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)
    before = reference.logprobs(base, PROMPT, result.output_ids)
    assert (before - expected).abs().max() > 0.02, "the update changed what is served"


@pytest.mark.parametrize(
    ("workers", "lora"), [(1, False), (2, False), (2, True)], ids=["1", "2-fsdp", "2-fsdp-lora"]
)
async def test_distributed_sync_from_trainer_actors_serves_the_trained_weights(
    torch_engine_factory, tiny_model_dir, reference, tmp_path, workers, lora
):
    engine = torch_engine_factory(weight_version=0)
    # LoRA: what is broadcast is the merged model (rank 0 merges the gathered state).
    settings = {"lora_rank": 8, "lora_alpha": 16.0, "learning_rate": 5e-2} if lora else {}
    group = await asyncio.to_thread(_group, tiny_model_dir, workers, **settings)
    trainer = CountingInit(group)
    reporter = ListReporter()
    sync = WeightSync(
        [engine.url],
        tmp_path / "weights",
        strategy="distributed",
        timeout_s=TIMEOUT_S,
        reporter=reporter,
    )
    client = InferenceClient(engine.url)
    try:
        for step in (1, 2):  # the second push reuses the group
            await asyncio.to_thread(group.train_step, _batch())
            assert await sync.push(trainer) == step == group.version
            assert await client.get_weight_version() == step
            weights = Path(await asyncio.to_thread(group.save_weights, str(tmp_path / f"w{step}")))
            await _assert_serves(client, reference, weights, step, tiny_model_dir)
            assert sync.last_timing["weight_sync/bytes"] > 0
        assert trainer.inits == 1
        assert reporter.events == []
        assert not (tmp_path / "weights").exists() or not list((tmp_path / "weights").iterdir())
    finally:
        await client.aclose()
        await sync.aclose(trainer)
        await asyncio.to_thread(group.close)


@pytest.mark.parametrize("workers", [1, 2])
async def test_adapter_sync_from_trainer_actors_serves_the_trained_adapter(
    torch_engine_factory, tiny_model_dir, reference, tmp_path, workers
):
    from rl_core.adapter_sync import AdapterSync

    engine = torch_engine_factory(weight_version=0, lora_rank=8)
    group = await asyncio.to_thread(
        _group, tiny_model_dir, workers, lora_rank=8, lora_alpha=16.0, learning_rate=5e-2
    )
    sync = AdapterSync([engine.url], tmp_path / "adapters", "runT", keep=1)
    client = InferenceClient(engine.url)
    try:
        for step in (1, 2):
            await asyncio.to_thread(group.train_step, _batch())
            assert await sync.push(group) == step == group.version
            assert sync.current == f"runT-v{step}"
            # The trainer's LoRA model, merged into full weights by save_weights.
            merged = Path(await asyncio.to_thread(group.save_weights, str(tmp_path / f"m{step}")))
            await _assert_serves(
                client, reference, merged, step, tiny_model_dir, lora_path=f"runT-v{step}"
            )
        await sync.drain()
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v2"]
        # The base model is served beside the adapter, untouched.
        plain = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
        torch.testing.assert_close(
            torch.tensor(plain.output_logprobs),
            reference.logprobs(tiny_model_dir, PROMPT, plain.output_ids),
            atol=2e-3,
            rtol=0,
        )
    finally:
        await client.aclose()
        await sync.aclose()
        await asyncio.to_thread(group.close)


async def test_a_server_dying_between_updates_stops_the_sync_and_the_workers_train_on(
    torch_engine_factory, tiny_model_dir, tmp_path
):
    engine = torch_engine_factory(weight_version=0)
    group = await asyncio.to_thread(_group, tiny_model_dir, 2)
    reporter = ListReporter()
    sync = WeightSync(
        [engine.url],
        tmp_path / "weights",
        strategy="distributed",
        timeout_s=TIMEOUT_S,
        reporter=reporter,
    )
    try:
        await asyncio.to_thread(group.train_step, _batch())
        await sync.push(group)  # the group is up
        engine.stop()
        await asyncio.to_thread(group.train_step, _batch())
        with pytest.raises(WeightSyncError, match="update_weights_from_disk"):
            await asyncio.wait_for(sync.push(group), 4 * TIMEOUT_S)
        assert [kind for kind, _ in reporter.events] == ["weight_sync"]
        assert "now take(s) weights from disk" in reporter.events[0][1]
        # No worker was left in a collective: both take the next step and save together.
        stats = await asyncio.wait_for(asyncio.to_thread(group.train_step, _batch()), 120)
        assert stats["version"] == 3.0
        saved = await asyncio.wait_for(
            asyncio.to_thread(group.save_weights, str(tmp_path / "after")), 120
        )
        assert (Path(saved) / "model.safetensors").exists()
    finally:
        await sync.aclose(group)
        await asyncio.to_thread(group.close)


async def test_a_hung_server_times_out_the_update_and_takes_weights_from_disk_once_back(
    torch_engine_factory, tiny_model_dir, reference, tmp_path
):
    """A server that stops answering (SIGSTOP) in the middle: rank 0's broadcast times out
    while rank 1 waits in FSDP's gathers; the push fails within the watchdog's bounds, the
    workers train on, and once the server is back it takes the next version from disk."""
    engine = torch_engine_factory(weight_version=0)
    group = await asyncio.to_thread(_group, tiny_model_dir, 2)
    reporter = ListReporter()
    sync = WeightSync(
        [engine.url], tmp_path / "weights", strategy="distributed", timeout_s=4.0, reporter=reporter
    )
    client = InferenceClient(engine.url)
    pid = engine.process.pid
    try:
        await asyncio.to_thread(group.train_step, _batch())
        await sync.push(group)  # the group is up
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.to_thread(group.train_step, _batch())
            with pytest.raises(WeightSyncError, match="update_weights_from_disk"):
                await asyncio.wait_for(sync.push(group), 120)  # the bounds add up to ~45 s
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [kind for kind, _ in reporter.events] == ["weight_sync"]
        assert "broadcast of version 2 failed" in reporter.events[0][1]
        await asyncio.wait_for(asyncio.to_thread(group.train_step, _batch()), 120)
        assert await asyncio.wait_for(sync.push(group), 120) == 3  # by disk now
        weights = Path(await asyncio.to_thread(group.save_weights, str(tmp_path / "w3")))
        await _assert_serves(client, reference, weights, 3, tiny_model_dir)
    finally:
        await client.aclose()
        await sync.aclose(group)
        await asyncio.to_thread(group.close)
