"""Failpoints: named places where a chaos test has the process SIGKILL itself, once.

A trainer killed at a random moment is mostly killed between the phases that matter; the
chaos tests (``tests/chaos/``) need it killed *inside* a training step, a checkpoint write
and a weight update. ``STEEP_FAILPOINTS`` names a JSON file holding a list of
``{"name": ..., "step": N}``; ``failpoint(name, step)`` takes the first entry for ``name``
whose step has been reached out of the file (rewritten atomically, so each entry fires
once, across restarts; several processes reaching it at once may all fire) and kills the
calling process with SIGKILL: no handler, no ``finally``, as an OOM kill or a lost node would.

The places: ``train_step`` (step N, after backward and before the optimizer step),
``checkpoint.write`` (the checkpoint of step N, its files written beside the final
directory but not yet renamed into place), ``weight_sync.broadcast`` (version N, after
the first tensor went to the servers). Without the variable, as in production, a
failpoint is an environment lookup.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

ENV = "STEEP_FAILPOINTS"
NAMES = ("train_step", "checkpoint.write", "weight_sync.broadcast")


def failpoint(name: str, step: int) -> None:
    """SIGKILL this process if the failpoints file has an entry for ``name`` at or below ``step``."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return
    for index, entry in enumerate(entries):
        if entry.get("name") == name and step >= int(entry.get("step", 0)):
            arm(path, entries[:index] + entries[index + 1 :])
            os.kill(os.getpid(), signal.SIGKILL)


def arm(path: str | Path, entries: list[dict]) -> None:
    """Write the failpoints file (atomically: a reader sees the old list or the new one)."""
    unknown = [e.get("name") for e in entries if e.get("name") not in NAMES]
    if unknown:
        raise ValueError(f"unknown failpoints {unknown}; the places are {', '.join(NAMES)}")
    # A file of this process's own: two trainer ranks reaching one failpoint at once both
    # rewrite the list, and a shared temporary name would be renamed away under one of them.
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries))
    tmp.replace(path)
