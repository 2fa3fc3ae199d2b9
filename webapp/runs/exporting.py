"""Exporting a checkpoint: ``python -m rl_core.export`` in a subprocess of a Celery worker.

The worker runs Django and, like the web process, never imports torch; the export (load,
merge a LoRA adapter or cast to the base dtype, write) runs in its own process with the
worker's torch thread budget. Requests and the status record go through
``webapp.runs.services`` (``checkpoint_export_request`` / ``checkpoint_export_finish``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from django.conf import settings

from webapp.runs.models import Checkpoint
from webapp.runs.services import EXPORT_TIMEOUT, checkpoint_export_finish

logger = logging.getLogger(__name__)

ERROR_TAIL_CHARS = 2000  # of the exporter's stderr, kept as export_error


def export_dir(checkpoint: Checkpoint) -> Path:
    """Where ``checkpoint``'s export goes: outside the run's checkpoints, which rotate."""
    return (
        Path(settings.DATA_DIR) / "exports" / str(checkpoint.run_id) / f"step_{checkpoint.step:06d}"
    )


def checkpoint_export_execute(*, checkpoint_id: int) -> str:
    """Run the export of a checkpoint whose export was requested; returns its outcome."""
    checkpoint = Checkpoint.objects.select_related("run").filter(pk=checkpoint_id).first()
    if checkpoint is None or checkpoint.export_status != Checkpoint.ExportStatus.RUNNING:
        return "skipped"  # deleted, or a duplicate delivery of the task
    out = export_dir(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ) | {"STEEP_TORCH_THREADS": str(settings.STEEP_TORCH_THREADS)}
    command = [sys.executable, "-m", "rl_core.export", checkpoint.path, str(out)]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=env,
            timeout=EXPORT_TIMEOUT.total_seconds(),
        )
    except subprocess.TimeoutExpired:
        checkpoint_export_finish(
            checkpoint=checkpoint, error=f"The export ran for longer than {EXPORT_TIMEOUT}."
        )
        return "failed"
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-ERROR_TAIL_CHARS:]
        logger.warning("export of checkpoint %s failed: %s", checkpoint_id, tail)
        checkpoint_export_finish(
            checkpoint=checkpoint, error=tail or f"The exporter exited with {result.returncode}."
        )
        return "failed"
    checkpoint_export_finish(checkpoint=checkpoint, path=str(out))
    return "done"
