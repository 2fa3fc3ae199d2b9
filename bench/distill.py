"""On-policy distillation against RL on the toy task (issue 38): reward and reverse KL per step.

    .venv/bin/python bench/distill.py [--steps 12] [--teacher-steps 12] [--topk 8] [--json out.json]
        [--task toy|demo] [--runs rl,topk,...] [--window 1] [--teacher DIR] [--lr X]

The tiny model (``rl_core.tiny``) on the toy task (``rl_core.toy``, ``TOY_SETTINGS``), one torch
engine per run, everything in this process's event loop (``rl_core.rollout.LocalRun``):

1. ``teacher``: RL on the task's reward for ``--teacher-steps`` steps; its weights are saved and
   served by an engine of their own (``tests/distill_teacher.py``);
2. ``rl``: the same RL run again (its reward per step is the baseline);
3. ``distill``: a fresh student distilled from the teacher, on its per-token signal alone
   (``reward_weight`` 0);
4. ``distill+reward``: both signals (``reward_weight`` 1, ``distill_weight`` 1);
5. ``distill+topk``: distillation alone (``reward_weight`` 0) with the teacher's top-k forward-KL
   term beside the sampled-token signal (``distill_topk`` ``--topk``, ``distill_topk_coef`` 1);
6. ``topk``: the top-k forward-KL term alone (``distill_weight`` 0 as well).

Reported per run: the reward per step, the reverse KL to the teacher per step (the teacher's runs
only; the top-k forward KL too where it is trained), the wall time, and the first step at which the run's reward reaches the ``rl`` run's final
reward (the mean of its last three steps) - the goal is at most half the RL run's steps.

``--task demo`` runs all of it on the demo task instead (``DEMO_SETTINGS``: say the letter, v or
a, the prompt asks for; learning rate 3e-4), where RL needs hundreds of steps; ``--window``
averages a run's reward over that many steps before comparing (the demo's batches are noisy).
``--teacher`` skips step 1 and serves that model directory (it must share the tiny model's
tokenizer, e.g. an earlier run's teacher, or ``bench/multi_agent.py``'s warm-up); ``--lr`` sets
every student's learning rate (the teacher keeps the task's). Each run's
figures go to the log (and ``--json``) as soon as it ends.
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
    model_dir: Path,
    url: str,
    settings: dict[str, Any],
    teacher_url: str = "",
    task: str = "toy",
) -> dict:
    from rl_core.config import RunConfig
    from rl_core.distill import SGLangTeacher, TeacherScorer
    from rl_core.loop import ListReporter
    from rl_core.rollout import LocalRun
    from rl_core.trainer import PPOTrainer
    from tests.distill_teacher import task_of

    task_settings, rows = task_of(task)
    extra = {"teacher_url": teacher_url} if teacher_url else {}
    cfg = RunConfig.from_dict({"base_model": str(model_dir), **task_settings, **settings, **extra})
    trainer = PPOTrainer(cfg, model_path=model_dir, device="cpu")
    reporter = ListReporter()
    scorer = (
        TeacherScorer(SGLangTeacher(teacher_url), topk=cfg.distill_topk) if teacher_url else None
    )
    started = time.perf_counter()
    try:
        await LocalRun(
            cfg,
            trainer=trainer,
            urls=[url],
            rows=rows,
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
        "topk_forward_kl": reporter.series("distill/topk_forward_kl"),
    }


def first_reaching(rewards: list[float], target: float, window: int = 1) -> int | None:
    """The first step whose reward (the mean of the ``window`` steps ending there) reaches
    ``target``."""
    means = [sum(rewards[i + 1 - window : i + 1]) / window for i in range(window - 1, len(rewards))]
    return next((i + window for i, r in enumerate(means) if r >= target), None)


async def main_async(args: argparse.Namespace) -> dict:
    from rl_core.inference.launch import TorchEngineServer
    from rl_core.tiny import build_tiny_model
    from tests.distill_teacher import rl_teacher, task_of

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
        if args.teacher:
            teacher_dir = args.teacher
        else:
            teacher_dir, _ = await rl_teacher(
                model_dir,
                engine(model_dir),
                root / "teacher",
                steps=args.teacher_steps,
                task=task_of(args.task),
            )
        teacher_url = engine(teacher_dir)
        steps = {"max_steps": args.steps} | ({"learning_rate": args.lr} if args.lr else {})
        topk = {"distill_topk": args.topk}
        plans = {
            "rl": ({}, ""),
            "distill": ({"reward_weight": 0.0}, teacher_url),
            "distill+reward": ({}, teacher_url),
            "distill+topk": ({"reward_weight": 0.0, **topk}, teacher_url),
            "topk": ({"reward_weight": 0.0, "distill_weight": 0.0, **topk}, teacher_url),
        }
        runs = {}
        for name in args.runs.split(","):
            settings, teacher = plans[name]
            runs[name] = await one_run(
                model_dir, engine(model_dir), {**steps, **settings}, teacher, args.task
            )
            rewards = " ".join(f"{r:.2f}" for r in runs[name]["reward"])
            print(f"{name}: {runs[name]['seconds']:.0f} s, reward per step {rewards}", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"partial": True, "runs": runs}, indent=2))
    finally:
        for server in servers:
            server.stop()
    last = max(3, args.window)
    target = sum(runs["rl"]["reward"][-last:]) / last
    for run in runs.values():
        run["reaches_rl_final_at"] = first_reaching(run["reward"], target - 1e-9, args.window)
    return {"rl_final_reward": target, "window": args.window, "task": args.task, "runs": runs}


def markdown(result: dict) -> str:
    runs = result["runs"]
    steps = max(len(r["reward"]) for r in runs.values())
    lines = [
        f"Task {result['task']}; RL's final reward (mean of its last "
        f"{max(3, result['window'])} steps): {result['rl_final_reward']:.3f}; a run reaches it "
        f"where the mean of its last {result['window']} step(s) does",
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
        if run.get("topk_forward_kl"):
            cells = [f"{k:.2f}" for k in run["topk_forward_kl"]]
            lines.append(f"| {name}: top-k forward KL | | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--teacher-steps", type=int, default=12)
    parser.add_argument("--topk", type=int, default=8, help="distill_topk of the distill+topk run")
    parser.add_argument("--task", choices=("toy", "demo"), default="toy")
    parser.add_argument(
        "--runs", default="rl,distill,distill+reward,distill+topk,topk", help="which, in order"
    )
    parser.add_argument("--window", type=int, default=1, help="steps a reward is averaged over")
    parser.add_argument("--lr", type=float, help="every student's learning rate (the task's)")
    parser.add_argument("--teacher", type=Path, help="serve this teacher instead of training one")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if "rl" not in args.runs.split(","):
        parser.error("--runs needs rl: the other runs are measured against it")
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
