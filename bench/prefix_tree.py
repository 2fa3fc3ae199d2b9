"""Prefix-tree training against flat packing (issue 37): one PPO step per workload and mode.

    .venv/bin/python bench/prefix_tree.py [--model smollm2|small] [--workloads grpo,fork,system,none]
        [--micro-batch-tokens 4096] [--threads 2] [--json out.json]

Workloads (token ids drawn at random; only their sharing matters):

- ``grpo``: one GRPO group, 8 answers of 100-400 tokens to one prompt of 1,000-2,000 tokens;
- ``fork``: two sessions of 10 turns (a turn: a 40-token user message and a 60-token answer)
  that fork into 4 sub-agent branches at turn 5: 4 trajectories a session, each with the
  conversation before the fork;
- ``system``: 8 online trajectories sharing a 500-token system prompt, then 200-600 tokens
  of their own;
- ``none``: 8 sequences of 300-800 tokens sharing nothing (tree training must not be slower).

Each (workload, mode) runs in a fresh process (its own peak memory): a ``PPOTrainer`` with
``prefix_tree`` off (``flat``) or on (``tree``), ``micro_batch_tokens`` as given, one warm-up
step, then ``--steps`` timed steps (the fastest reported). Columns: ``computed/token`` (tokens the
model ran over per packed token, ``perf/computed_tokens_per_token``), step time, CPU time,
peak memory (``perf/peak_memory_gb``: peak RSS on CPUs) and the step's loss, which must agree
between the modes (the first step's loss, before any update, is the one compared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.train_step import build_model  # noqa: E402

WORKLOADS = ("grpo", "fork", "system", "none")


def workload(name: str, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``(token ids, prompt length)`` of each trajectory of ``name``."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    if name == "grpo":
        prompt = tokens(rng.randrange(1000, 2001))
        return [(prompt + tokens(rng.randrange(100, 401)), len(prompt)) for _ in range(8)]
    if name == "fork":
        out = []
        for _ in range(2):
            trunk = [t for _ in range(5) for t in tokens(40) + tokens(60)]
            for _ in range(4):
                branch = [t for _ in range(5) for t in tokens(40) + tokens(60)]
                out.append((trunk + branch, 40))
        return out
    if name == "system":
        system = tokens(500)
        return [(system + tokens(rng.randrange(200, 601)), 500) for _ in range(8)]
    if name == "none":
        return [(tokens(rng.randrange(300, 801)), 50) for _ in range(8)]
    raise ValueError(f"unknown workload {name!r}")


def trajectories(name: str, vocab: int) -> list[Any]:
    from rl_core.types import Trajectory

    rng = random.Random(1)
    out = []
    for ids, n_prompt in workload(name, vocab):
        mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
        out.append(
            Trajectory(
                ids,
                mask,
                [-rng.uniform(0.5, 3.0) * m for m in mask],
                [0 if m else -1 for m in mask],
                [rng.random()],
            )
        )
    return out


def run(name: str, tree: bool, args: argparse.Namespace, model_dir: str, out: str) -> None:
    import torch

    from rl_core.config import RunConfig
    from rl_core.trainer import PPOTrainer

    torch.set_num_threads(args.threads)
    trainer = PPOTrainer(
        RunConfig.from_dict(
            {
                "base_model": model_dir,
                "mode": "online",
                "batch_size": 8,
                "learning_rate": 1e-6,
                "micro_batch_tokens": args.micro_batch_tokens,
                "prefix_tree": tree,
                "seed": 0,
            }
        ),
        device="cpu",
    )
    batch = trajectories(name, trainer.model.config.vocab_size)
    first = trainer.train_step(batch)  # warm-up; its loss is before any update
    timed = []
    for _ in range(args.steps):
        cpu = time.process_time()
        stats = trainer.train_step(batch)
        timed.append((stats["perf/step_s"], time.process_time() - cpu, stats))
    step_s, cpu_s, stats = min(timed, key=lambda t: t[0])
    Path(out).write_text(
        json.dumps(
            {
                "workload": name,
                "mode": "tree" if tree else "flat",
                "sequences": len(batch),
                "tokens": sum(len(t.input_ids) for t in batch),
                "computed_per_token": stats["perf/computed_tokens_per_token"],
                "step_s": step_s,
                "cpu_s": cpu_s,
                "peak_memory_gb": max(s["perf/peak_memory_gb"] for _, _, s in timed),
                "first_loss": first["ppo/loss"],
            }
        )
    )


def isolated(name: str, tree: bool, args: argparse.Namespace, model_dir: str) -> dict:
    import torch.multiprocessing as mp

    out = os.path.join(tempfile.mkdtemp(prefix="steep-tree-bench-"), "result.json")
    proc = mp.get_context("spawn").Process(target=run, args=(name, tree, args, model_dir, out))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        return {"workload": name, "mode": "tree" if tree else "flat", "failed": proc.exitcode}
    return json.loads(Path(out).read_text())


def markdown(rows: list[dict]) -> str:
    lines = [
        "| workload | mode | sequences | tokens | computed/token | step s | CPU s | peak GB | "
        "speed-up | first loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    flat = {r["workload"]: r for r in rows if r["mode"] == "flat" and "failed" not in r}
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['workload']} | {r['mode']} | failed (exit {r['failed']}) |")
            continue
        base = flat.get(r["workload"])
        speedup = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['sequences']} | {r['tokens']:,} | "
            f"{r['computed_per_token']:.3f} | {r['step_s']:.2f} | {r['cpu_s']:.2f} | "
            f"{r['peak_memory_gb']:.2f} | {speedup} | {r['first_loss']:.6f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "small"))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model_dir = str(build_model(args.model, ROOT / ".steep" / "bench" / "models"))
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, model {args.model}, "
        f"micro_batch_tokens {args.micro_batch_tokens}, {args.threads} threads",
        flush=True,
    )
    rows = []
    for name in args.workloads.split(","):
        for tree in (False, True):
            rows.append(isolated(name, tree, args, model_dir))
            print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
