"""Loop checkpoints: the trainer's state plus the loop's position, and finding the latest one.

A checkpoint is a directory ``step_<step>`` holding whatever ``trainer.save_checkpoint``
writes and, written last, ``loop_state.json`` (``{"step", "version", "counters"}``; counters:
the staleness controller's running totals at that step): its presence marks the checkpoint
complete, so one interrupted mid-write is never resumed from.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

LOOP_STATE = "loop_state.json"  # written last into a checkpoint: its presence marks it complete


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint directory and the loop position it resumes at."""

    path: Path
    step: int
    version: int
    counters: dict[str, int] = field(default_factory=dict)  # the controller's, at that step


def latest_checkpoint(checkpoint_dir: str | Path | None) -> CheckpointInfo | None:
    """The checkpoint with the highest step in ``checkpoint_dir`` (only complete ones count)."""
    if checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        return None
    found = []
    for state_file in Path(checkpoint_dir).glob(f"step_*/{LOOP_STATE}"):
        try:
            state = json.loads(state_file.read_text())
            counters = {str(k): int(v) for k, v in (state.get("counters") or {}).items()}
            found.append(
                CheckpointInfo(
                    state_file.parent, int(state["step"]), int(state["version"]), counters
                )
            )
        except (OSError, ValueError, KeyError):
            logger.warning("ignoring unreadable checkpoint state %s", state_file)
    return max(found, key=lambda c: c.step, default=None)


def write_checkpoint(
    save: Callable[[str], object],
    checkpoint_dir: Path,
    step: int,
    version: int,
    *,
    keep: int | None = None,
    counters: dict[str, int] | None = None,
) -> tuple[Path, int]:
    """``save(path)`` the trainer's state into ``checkpoint_dir/step_<step>``, then the loop state.

    Returns the directory and its size in bytes. With ``keep``, only the newest ``keep``
    complete checkpoints stay on disk. Blocking: run it in a thread.
    """
    path = checkpoint_dir / f"step_{step:06d}"
    save(str(path))
    state = {"step": step, "version": version, "counters": counters or {}}
    (path / LOOP_STATE).write_text(json.dumps(state))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if keep:
        complete = sorted(checkpoint_dir.glob(f"step_*/{LOOP_STATE}"), key=lambda p: p.parent.name)
        for old in complete[:-keep]:
            shutil.rmtree(old.parent, ignore_errors=True)
    return path, size
