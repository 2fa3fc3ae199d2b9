"""On-policy distillation against RL on the toy task (issue 38): reward and reverse KL per step.

    .venv/bin/python bench/distill.py [--steps 12] [--teacher-steps 12] [--json out.json]

The tiny model (``rl_core.tiny``) on the toy task (``rl_core.toy``, ``TOY_SETTINGS``), one torch
engine per run, everything in this process's event loop (``rl_core.rollout.LocalRun``):

1. ``teacher``: RL on the task's reward for ``--teacher-steps`` steps; its weights are saved and
   served by an engine of their own (``tests/distill_teacher.py``);
2. ``rl``: the same RL run again (its reward per step is the baseline);
3. ``distill``: a fresh student distilled from the teacher, on its per-token signal alone
   (``reward_weight`` 0);
4. ``distill+reward``: both signals (``reward_weight`` 1, ``distill_weight`` 1).

Reported per run: the reward per step, the reverse KL to the teacher per step (the teacher's runs
only), the wall time, and the first step at which the run's reward reaches the ``rl`` run's final
reward (the mean of its last three steps) - the goal is at most half the RL run's steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def one_run(
    model_dir: Path, url: str, settings: dict[str, Any], teacher_url: str = ""
) -> dict:
    from rl_core.config import RunConfig
    from rl_core.distill import SGLangTeacher, TeacherScorer
    from rl_core.loop import ListReporter
    from rl_core.rollout import LocalRun
    from rl_core.toy import TOY_SETTINGS, toy_rows
    from rl_core.trainer import PPOTrainer

    extra = {"teacher_url": teacher_url} if teacher_url else {}
    cfg = RunConfig.from_dict({"base_model": str(model_dir), **TOY_SETTINGS, **settings, **extra})
    trainer = PPOTrainer(cfg, model_path=model_dir, device="cpu")
    reporter = ListReporter()
    scorer = TeacherScorer(SGLangTeacher(teacher_url)) if teacher_url else None
    started = time.perf_counter()
    try:
        await LocalRun(
            cfg,
            trainer=trainer,
            urls=[url],
            rows=toy_rows(64, seed=0),
            weights_dir=Path(tempfile.mkdtemp(prefix="steep-distill-")),
            reporter=reporter,
            teacher=scorer,
        ).run()
    finally:
        if scorer is not None:
            await scorer.aclose()
    return {
        "seconds": time.perf_counter() - started,
        "reward": reporter.series("rollout/reward"),
        "reverse_kl": reporter.series("distill/reverse_kl"),
    }


def first_reaching(rewards: list[float], target: float) -> int | None:
    return next((i + 1 for i, r in enumerate(rewards) if r >= target), None)


async def main_async(args: argparse.Namespace) -> dict:
    from rl_core.inference.launch import TorchEngineServer
    from rl_core.tiny import build_tiny_model
    from tests.distill_teacher import rl_teacher

    root = Path(tempfile.mkdtemp(prefix="steep-distill-bench-"))
    model_dir = build_tiny_model(root / "tiny")
    servers: list[TorchEngineServer] = []

    def engine(path: Path) -> str:
        server = TorchEngineServer(path, host="127.0.0.1", num_threads=1, weight_version=0)
        server.start()
        server.wait_healthy(timeout=120)
        servers.append(server)
        return server.url

    try:
        teacher_dir, _ = await rl_teacher(
            model_dir, engine(model_dir), root / "teacher", steps=args.teacher_steps
        )
        teacher_url = engine(teacher_dir)
        steps = {"max_steps": args.steps}
        runs = {
            "rl": await one_run(model_dir, engine(model_dir), steps),
            "distill": await one_run(
                model_dir, engine(model_dir), {**steps, "reward_weight": 0.0}, teacher_url
            ),
            "distill+reward": await one_run(model_dir, engine(model_dir), steps, teacher_url),
        }
    finally:
        for server in servers:
            server.stop()
    target = sum(runs["rl"]["reward"][-3:]) / 3
    for run in runs.values():
        run["reaches_rl_final_at"] = first_reaching(run["reward"], target - 1e-9)
    return {"rl_final_reward": target, "runs": runs}


def markdown(result: dict) -> str:
    runs = result["runs"]
    steps = max(len(r["reward"]) for r in runs.values())
    lines = [
        f"RL's final reward (mean of its last 3 steps): {result['rl_final_reward']:.3f}",
        "",
        "| run | first step at RL's final reward | wall s | "
        + " | ".join(f"step {i + 1}" for i in range(steps))
        + " |",
        "|---|---:|---:|" + "---:|" * steps,
    ]
    for name, run in runs.items():
        cells = [f"{r:.2f}" for r in run["reward"]]
        lines.append(
            f"| {name}: reward | {run['reaches_rl_final_at'] or '-'} | {run['seconds']:.0f} | "
            + " | ".join(cells)
            + " |"
        )
        if run["reverse_kl"]:
            cells = [f"{k:.2f}" for k in run["reverse_kl"]]
            lines.append(f"| {name}: reverse KL | | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--teacher-steps", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    result = asyncio.run(main_async(args))
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
