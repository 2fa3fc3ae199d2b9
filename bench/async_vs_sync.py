"""Asynchronous vs synchronous RL on one machine: trajectories trained per second.

The same tiny model (``rl_core.tiny``), the same prompts and the same long-tailed
response lengths are trained for ``--steps`` steps twice, back to back: once with
``max_staleness = 0`` (synchronous: generate a batch, train, repeat) and once
with ``max_staleness = 4`` (asynchronous: generation continues while the
trainer trains, within the staleness bound). Each run gets a fresh torch-engine
server and a fresh trainer; everything else (``LocalRun``: rollout driver →
queue → ``TrainingLoop`` → weight sync) is the production code path.

Response lengths: every group (prompt) draws its ``max_new_tokens`` from a
Pareto distribution (``--alpha``, ``--min-tokens``, capped at ``--max-tokens``)
and generates with ``ignore_eos``, so lengths are independent of the reward
and identical across the two runs (the draws come from the driver's seeded RNG,
in group order). Synchronous RL waits for the longest answer of every batch;
asynchronous RL keeps the server's batch full with the next rollouts meanwhile.

    python bench/async_vs_sync.py [--steps 30] [--batch-size 16] [--group-size 4]

Prints one row per mode and the async/sync ratios of trajectories and of response
tokens trained per second (asynchronous runs drop the longest answers when they
end up more than ``max_staleness`` versions old, so the two ratios differ).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.config import RunConfig  # noqa: E402
from rl_core.inference.launch import TorchEngineServer  # noqa: E402
from rl_core.loop import ListReporter  # noqa: E402
from rl_core.rollout import LocalRun  # noqa: E402
from rl_core.tiny import build_tiny_model  # noqa: E402
from rl_core.toy import TOY_REWARD, toy_rows  # noqa: E402


class TimedReporter(ListReporter):
    """Remembers when each step was reported."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    async def metrics(self, step: int, version: int, values: dict[str, float]) -> None:
        self.times.append(time.perf_counter())
        await super().metrics(step, version, values)


def pareto_lengths(alpha: float, low: int, high: int):
    """``sampling_overrides`` for the driver: a heavy-tailed max_new_tokens per group, EOS ignored."""

    def overrides(row: dict[str, Any], rng: Any) -> dict[str, Any]:
        u = 1.0 - rng.random()  # (0, 1]
        return {"max_new_tokens": min(high, int(low * u ** (-1.0 / alpha))), "ignore_eos": True}

    return overrides


async def one_run(args: argparse.Namespace, model: Path, max_staleness: int, work: Path) -> dict:
    import torch

    from rl_core.trainer import PPOTrainer

    torch.set_num_threads(args.trainer_threads)
    cfg = RunConfig.from_dict(
        {
            "base_model": str(model),
            "reward": TOY_REWARD,
            "batch_size": args.batch_size,
            "group_size": args.group_size,
            "max_new_tokens": args.max_tokens,
            "max_staleness": max_staleness,
            "learning_rate": 1e-4,
            "max_steps": args.steps,
            "save_every": 10**6,
            "seed": args.seed,
            "weight_sync": "disk" if args.weight_sync == "stop-the-world" else args.weight_sync,
        }
    )
    server = TorchEngineServer(
        model,
        num_threads=args.engine_threads,
        max_running_requests=args.max_running_requests,
        weight_version=0,
        log_path=work / f"engine-s{max_staleness}.log",
    )
    with server:
        trainer = PPOTrainer(cfg, device="cpu")
        reporter = TimedReporter()
        run = LocalRun(
            cfg,
            trainer=trainer,
            urls=[server.url],
            rows=toy_rows(256, seed=args.seed),
            weights_dir=work / f"weights-s{max_staleness}",
            reporter=reporter,
            sampling_overrides=pareto_lengths(args.alpha, args.min_tokens, args.max_tokens),
        )
        if args.weight_sync == "stop-the-world":  # the path before issue #14: abort, reload
            run.weight_sync.pause_mode = "abort"
        started = time.perf_counter()
        await run.run(args.steps)
        elapsed = time.perf_counter() - started
    times = reporter.times
    steady = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")

    def mean(name: str) -> float:
        values = reporter.series(name)
        return sum(values) / len(values) if values else float("nan")

    trained = args.steps * args.batch_size
    tokens = sum(
        n * length
        for n, length in zip(
            reporter.series("rollout/num_trajectories"),
            reporter.series("rollout/response_tokens"),
            strict=True,
        )
    )
    return {
        "max_staleness": max_staleness,
        "steps": len(times),
        "time_to_n_steps_s": elapsed,
        "trajectories_per_s": trained / elapsed,
        "steady_trajectories_per_s": args.batch_size / steady,
        "trained_tokens_per_s": tokens / elapsed,
        "response_tokens_mean": mean("rollout/response_tokens"),
        "step_s": mean("timing/step"),
        "wait_batch_s": mean("timing/wait_batch"),
        "train_step_s": mean("timing/train_step"),
        "weight_sync_s": mean("timing/weight_sync"),
        "inference_stall_s": mean("timing/inference_stall"),
        "staleness_mean": mean("staleness/mean"),
        "mixed_version_frac": mean("staleness/mixed_version_frac"),
        "dropped": sum(reporter.series("staleness/dropped")),
        "generated_episodes": run.driver.stats["episodes_submitted"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=1.0, help="Pareto tail index of lengths")
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--async-staleness", type=int, default=4)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model dir (default: build the tiny model)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--weight-sync",
        choices=["distributed", "disk", "stop-the-world"],
        default="distributed",
        help="how weights reach the engine (stop-the-world: pause with abort, as before #14)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # Lengths, not rewards, are the point here: all-zero advantages are expected.
    logging.getLogger("rl_core.advantages").setLevel(logging.ERROR)

    work = Path(tempfile.mkdtemp(prefix="steep-bench-"))
    try:
        model = Path(args.model) if args.model else build_tiny_model(work / "tiny")
        results = []
        for staleness in (0, args.async_staleness):
            results.append(asyncio.run(one_run(args, model, staleness, work)))
            r = results[-1]
            print(
                f"max_staleness={staleness}: {r['steps']} steps in {r['time_to_n_steps_s']:.1f}s, "
                f"{r['trajectories_per_s']:.2f} traj/s (steady {r['steady_trajectories_per_s']:.2f}), "
                f"{r['trained_tokens_per_s']:.0f} trained tokens/s ({r['response_tokens_mean']:.0f}/traj), "
                f"step {r['step_s']:.2f}s = wait {r['wait_batch_s']:.2f} + train {r['train_step_s']:.2f} "
                f"+ sync {r['weight_sync_s']:.2f} (stall {r['inference_stall_s']:.3f}); staleness {r['staleness_mean']:.2f}, "
                f"mixed {r['mixed_version_frac']:.2f}, dropped {r['dropped']:.0f}",
                flush=True,
            )
        sync, async_ = results
        ratio = async_["trajectories_per_s"] / sync["trajectories_per_s"]
        steady_ratio = async_["steady_trajectories_per_s"] / sync["steady_trajectories_per_s"]
        token_ratio = async_["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
        print(
            f"async/sync trajectories per second: {ratio:.2f}x (steady state {steady_ratio:.2f}x); "
            f"trained tokens per second: {token_ratio:.2f}x; "
            f"time to {args.steps} steps {sync['time_to_n_steps_s']:.1f}s -> "
            f"{async_['time_to_n_steps_s']:.1f}s. AReaL reports 2.77x."
        )
        summary = {
            "args": vars(args),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "results": results,
            "ratio": ratio,
            "steady_ratio": steady_ratio,
            "token_ratio": token_ratio,
        }
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
