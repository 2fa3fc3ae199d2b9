"""A teacher that is good at the toy task, for distillation tests and ``bench/distill.py``.

The tiny model trained on the toy task by RL (``TOY_SETTINGS``, ``steps`` steps: its reward
reaches ~0.75, "vvvvvvvv") and saved with the student's tokenizer: a stronger model of the same
tokenizer, as a distillation run would learn from. Needs a torch engine serving the untrained
model at version 0 (the run updates its weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEACHER_STEPS = 12


async def rl_teacher(
    model_dir: str | Path,
    engine_url: str,
    out: Path,
    steps: int = TEACHER_STEPS,
    task: tuple[dict[str, Any], list[dict[str, Any]]] | None = None,
) -> tuple[Path, list[float]]:
    """The model of ``model_dir`` after ``steps`` RL steps on the toy task (or ``task``: its
    settings and rows), saved to ``out``; and that run's reward per step."""
    from rl_core.config import RunConfig
    from rl_core.loop import ListReporter
    from rl_core.rollout import LocalRun
    from rl_core.toy import TOY_SETTINGS, toy_rows
    from rl_core.trainer import PPOTrainer

    settings, rows = task or (TOY_SETTINGS, toy_rows(64, seed=0))
    cfg = RunConfig.from_dict({"base_model": str(model_dir), **settings, "max_steps": steps})
    trainer = PPOTrainer(cfg, model_path=model_dir, device="cpu")
    reporter = ListReporter()
    await LocalRun(
        cfg,
        trainer=trainer,
        urls=[engine_url],
        rows=rows,
        weights_dir=out.parent / f"{out.name}-sync",
        reporter=reporter,
    ).run()
    saved = Path(trainer.save_weights(str(out)))
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (saved / f.name).write_bytes(f.read_bytes())
    return saved, reporter.series("rollout/reward")


def task_of(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A task's run settings and rows: ``toy`` (say "v") or ``demo`` (say the letter asked)."""
    from rl_core.toy import DEMO_SETTINGS, TOY_SETTINGS, demo_rows, toy_rows

    if name == "demo":
        return DEMO_SETTINGS, demo_rows(512, seed=0)
    return TOY_SETTINGS, toy_rows(64, seed=0)
