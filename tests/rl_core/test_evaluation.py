"""Evaluation: the held-out split, pass@k, bootstrap intervals, and the real thing — a toy
model trained for a few steps scores higher than the base model on rows it never saw."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from rl_core.config import ConfigError, RunConfig
from rl_core.evals import bootstrap_ci, pass_at_k, split_rows, summarize
from rl_core.toy import TOY_REWARD, TOY_SETTINGS, toy_rows


def test_pass_at_k_is_chen_et_als_unbiased_estimate():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0  # k = n: any pass
    assert pass_at_k(5, 4, 2) == 1.0  # fewer failures than k
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_bootstrap_interval_is_seeded_and_holds_the_mean():
    values = [0.0, 0.0, 1.0, 1.0, 0.5, 0.25, 0.75, 1.0]
    low, high = bootstrap_ci(values)
    assert (low, high) == bootstrap_ci(values)
    assert low < sum(values) / len(values) < high
    assert 0.0 <= low and high <= 1.0
    assert bootstrap_ci([0.4]) == (0.4, 0.4)
    assert bootstrap_ci([1.0] * 5) == (1.0, 1.0)


def test_summary_averages_examples_and_their_pass_at_k():
    summary = summarize([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], k=2, threshold=1.0)
    assert summary.examples == 3 and summary.samples == 6
    assert summary.mean_reward == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert summary.pass_at_k == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    k1 = summarize([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], k=1, threshold=1.0)
    assert k1.pass_at_k == pytest.approx((0.5 + 0.0 + 1.0) / 3)


def test_held_out_rows_are_stable_disjoint_and_about_the_fraction():
    rows = [{"prompt": f"p{i}"} for i in range(1000)]
    train, held = split_rows(rows, 0.1, seed=3)
    assert len(train) + len(held) == 1000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert 60 < len(held) < 140
    assert split_rows(rows, 0.1, seed=3) == (train, held)
    assert split_rows(rows, 0.1, seed=4)[1] != held
    assert split_rows(rows, 0.0) == (rows, [])
    # A tiny dataset keeps at least one row on each side.
    two = rows[:2]
    assert [len(part) for part in split_rows(two, 0.9)] == [1, 1]


def test_eval_settings_are_validated_with_what_to_set():
    base = {"base_model": "m", "reward": {"type": "exact_match"}}
    with pytest.raises(ConfigError) as missing:
        RunConfig.from_dict(base | {"eval_every": 5})
    assert "eval_fraction" in missing.value.errors
    with pytest.raises(ConfigError) as online:
        RunConfig.from_dict({"base_model": "m", "mode": "online", "eval_every": 5})
    assert "eval_every" in online.value.errors
    with pytest.raises(ConfigError):
        RunConfig.from_dict(base | {"eval_fraction": 0.95})
    cfg = RunConfig.from_dict(base | {"eval_every": 5, "eval_fraction": 0.1, "eval_k": 2})
    assert (cfg.eval_every, cfg.eval_fraction, cfg.eval_k) == (5, 0.1, 2)


@pytest.mark.slow
async def test_the_trained_toy_model_beats_the_base_model_on_held_out_rows(
    tiny_model_dir, torch_engine_factory, tmp_path
):
    from rl_core.checkpoints import latest_checkpoint
    from rl_core.evaluate import evaluate
    from rl_core.rollout import LocalRun
    from rl_core.trainer import PPOTrainer

    rows = toy_rows(48, seed=0)
    train, held = split_rows(rows, 0.25, seed=0)
    cfg = RunConfig.from_dict(
        {"base_model": str(tiny_model_dir), **TOY_SETTINGS, "max_steps": 12, "save_every": 12}
    )
    engine = torch_engine_factory(weight_version=0)
    run = LocalRun(
        cfg,
        trainer=PPOTrainer(cfg, model_path=tiny_model_dir, device="cpu"),
        urls=[engine.url],
        rows=train,
        weights_dir=tmp_path / "weights",
        checkpoint_dir=tmp_path / "checkpoints",
    )
    await run.run()
    checkpoint = latest_checkpoint(tmp_path / "checkpoints")
    assert checkpoint is not None and checkpoint.step == 12

    settings = {
        "tokenizer": str(tiny_model_dir),
        "reward": TOY_REWARD,
        "k": 4,
        "max_new_tokens": 8,
        "temperature": 1.0,
    }
    scores = {}
    for name, model in (("base", tiny_model_dir), ("trained", checkpoint.path)):
        results = evaluate(model, held, tmp_path / f"{name}.jsonl", **settings)
        lines = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert lines == results and len(results) == len(held)
        assert all(len(r["completions"]) == len(r["rewards"]) == 4 for r in results)
        scores[name] = summarize([r["rewards"] for r in results], k=4, threshold=0.5)
    base, trained = scores["base"], scores["trained"]
    assert trained.mean_reward > base.mean_reward + 0.3, (base, trained)
    # Sampled by a torch engine started on the checkpoint, seeded per answer as rollouts are.
    # (In a thread: the evaluation runs its own event loop, as its own process does.)
    served = await asyncio.to_thread(
        evaluate, checkpoint.path, held, tmp_path / "served.jsonl", engine="server",
        backend="torch", **settings,
    )  # fmt: skip
    on_server = summarize([r["rewards"] for r in served], k=4, threshold=0.5)
    assert on_server.mean_reward > base.mean_reward + 0.3, (base, on_server)
    assert trained.mean_reward_ci[0] > base.mean_reward_ci[1], (base, trained)
    assert trained.pass_at_k > base.pass_at_k, (base, trained)
    # Seeded sampling: the same model gives the same answers again.
    again = evaluate(tiny_model_dir, held[:2], tmp_path / "again.jsonl", **settings)
    first = [json.loads(x) for x in (tmp_path / "base.jsonl").read_text().splitlines()][:2]
    assert again == first


def test_a_lora_checkpoint_is_evaluated_with_its_adapter_merged(tiny_model_dir, tmp_path):
    import torch

    from rl_core.evaluate import load_model
    from rl_core.export import export_checkpoint
    from rl_core.hf import load_causal_lm
    from rl_core.trainer import PPOTrainer
    from rl_core.types import Trajectory

    cfg = RunConfig.from_dict(
        {
            "base_model": str(tiny_model_dir),
            "reward": {"type": "exact_match"},
            "batch_size": 2,
            "group_size": 2,
            "lora_rank": 4,
            "learning_rate": 5e-2,
        }
    )
    trainer = PPOTrainer(cfg, device="cpu")
    gen = torch.Generator().manual_seed(0)
    batch = []
    for i in range(2):
        ids = torch.randint(0, 256, (8,), generator=gen).tolist()
        mask = [0] * 3 + [1] * 5
        batch.append(Trajectory(ids, mask, [0.0] * 8, [0 if m else -1 for m in mask], [float(i)]))
    trainer.train_step(batch)
    checkpoint = tmp_path / "step_000001"
    trainer.save_checkpoint(checkpoint)

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        evaluated = load_model(checkpoint, torch.device("cpu"))(ids).logits
        merged = load_causal_lm(
            export_checkpoint(checkpoint, tmp_path / "merged"), torch.float32, torch.device("cpu")
        )(ids).logits
        base = load_causal_lm(tiny_model_dir, torch.float32, torch.device("cpu"))(ids).logits
    torch.testing.assert_close(evaluated, merged, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(evaluated, base, atol=1e-4), "the adapter must change the model"


def test_an_evaluation_on_an_inference_server_answers_as_the_local_model(
    tiny_model_dir, tmp_path, capsys
):
    """Greedy answers of a LoRA checkpoint: the torch engine started for the evaluation (on the
    streamed, merged export) gives the local model's; the server is gone afterwards."""
    import torch

    from rl_core.evaluate import evaluate
    from rl_core.trainer import PPOTrainer
    from rl_core.types import Trajectory

    cfg = RunConfig.from_dict(
        {"base_model": str(tiny_model_dir), **TOY_SETTINGS, "lora_rank": 4,
         "learning_rate": 5e-2}
    )  # fmt: skip
    trainer = PPOTrainer(cfg, device="cpu")
    gen = torch.Generator().manual_seed(0)
    batch = []
    for i in range(4):
        ids = torch.randint(0, 256, (10,), generator=gen).tolist()
        mask = [0] * 3 + [1] * 7
        batch.append(Trajectory(ids, mask, [0.0] * 10, [0 if m else -1 for m in mask], [float(i)]))
    trainer.train_step(batch)
    checkpoint = tmp_path / "step_000001"
    trainer.save_checkpoint(checkpoint)

    rows = toy_rows(6, seed=1)
    settings = {
        "tokenizer": str(tiny_model_dir),
        "reward": TOY_REWARD,
        "k": 2,
        "max_new_tokens": 12,
        "temperature": 0.0,
    }
    local = evaluate(checkpoint, rows, tmp_path / "local.jsonl", engine="local", **settings)
    (tmp_path / "served").mkdir()
    out = tmp_path / "served" / "results.jsonl"
    served = evaluate(checkpoint, rows, out, engine="server", backend="torch", **settings)
    assert [json.loads(x) for x in out.read_text().splitlines()] == served
    assert len(served) == len(rows)
    assert [r["completions"] for r in served] == [r["completions"] for r in local]
    assert [r["rewards"] for r in served] == [r["rewards"] for r in local]
    assert any(c for r in served for c in r["completions"])
    # The server is stopped and the export it served removed; its log stays beside the results.
    import httpx

    (url,) = [line.split()[2] for line in capsys.readouterr().out.splitlines() if "server" in line]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
    assert not (tmp_path / "served" / "served-model").exists()
    assert (tmp_path / "served" / "server.log").is_file()


async def test_the_loop_also_checkpoints_at_each_eval_step(tmp_path):
    from pathlib import Path

    from rl_core.loop import ListReporter, QueueSource, TrainingLoop
    from rl_core.types import Trajectory

    class CountingTrainer:
        version = 0

        def train_step(self, trajectories):
            self.version += 1
            return {"rollout/reward": 0.0}

        def save_weights(self, path):
            return path

        def save_checkpoint(self, path):
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "state").write_text(str(self.version))
            return path

        def load_checkpoint(self, path):
            self.version = int((Path(path) / "state").read_text())

    cfg = RunConfig.from_dict(
        {"base_model": "m", "reward": {"type": "exact_match"}, "batch_size": 1, "group_size": 1,
         "save_every": 100, "eval_every": 2, "eval_fraction": 0.1}
    )  # fmt: skip
    source, reporter = QueueSource(), ListReporter()
    for i in range(5):
        await source.put(f"k{i}", Trajectory([1, 2], [0, 1], [0.0, 0.0], [-1, 0], [1.0]))
    loop = TrainingLoop(cfg, CountingTrainer(), source, None, reporter, None, tmp_path)
    await loop.run(max_steps=5)
    assert [c["step"] for c in reporter.checkpoints] == [2, 4, 5]  # eval steps, then the end


def test_evals_sample_from_the_runs_nucleus(tiny_model_dir):
    """top_p keeps the smallest set of most likely tokens whose mass reaches it: near 0 only the
    most likely token is left (greedy), at 1 the model's full distribution is sampled."""
    import torch

    from rl_core.evaluate import load_model, nucleus, sample

    probs = torch.tensor([[0.5, 0.15, 0.3, 0.05], [0.04, 0.06, 0.1, 0.8]])
    kept = {p: (nucleus(probs, p) > 0).int().tolist() for p in (0.7, 0.85)}
    assert kept == {0.7: [[1, 0, 1, 0], [0, 0, 0, 1]], 0.85: [[1, 1, 1, 0], [0, 0, 1, 1]]}
    assert torch.equal(nucleus(probs, 0.85)[0, :3], probs[0, :3])  # what is kept is unchanged
    assert nucleus(probs, 1.0) is probs

    model = load_model(tiny_model_dir, torch.device("cpu"))
    common = {"prompt": [72, 105, 33], "k": 6, "max_new_tokens": 8, "stop_ids": set(), "seed": 3}
    greedy = sample(model, temperature=0.0, **common)
    assert sample(model, temperature=1.0, top_p=1e-6, **common) == greedy
    assert len({tuple(a) for a in sample(model, temperature=1.0, top_p=1.0, **common)}) > 1
