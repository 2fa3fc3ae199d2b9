"""Running an eval: ``python -m rl_core.evaluate`` in a subprocess of a Celery worker.

The worker runs Django and never imports torch; the evaluation (load the model, or start an
inference server of the run's backend on it, sample, score) runs in its own process at the
lowest CPU priority (see ``rl_core.evaluate`` for why not on the run's inference servers).
Its ``progress`` lines move the eval's progress.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import connection

from rl_core.config import stored_setting
from rl_core.evals import split_rows
from rl_core.sources import errors_text
from webapp.datasets.selectors import dataset_rows
from webapp.evals.models import Eval
from webapp.evals.services import (
    eval_fail,
    eval_finish,
    eval_heartbeat,
    eval_progress,
    eval_start,
    read_results,
)
from webapp.metrics.multiprocess import child_environment
from webapp.runs.sources import run_sourced

logger = logging.getLogger(__name__)

EVAL_TIMEOUT = timedelta(hours=6)
ERROR_TAIL_CHARS = 2000


def eval_dir(evaluation: Eval) -> Path:
    return Path(settings.DATA_DIR) / "evals" / str(evaluation.run_id) / str(evaluation.pk)


def eval_rows(evaluation: Eval) -> list[dict]:
    """The rows ``evaluation`` scores: the dataset's, or the run's held-out share of them."""
    rows = list(dataset_rows(dataset=evaluation.dataset))
    if evaluation.split == Eval.Split.HELD_OUT:
        config = evaluation.run.config
        _, rows = split_rows(
            rows,
            float(stored_setting(config, "eval_fraction")),
            int(stored_setting(config, "seed")),
        )
    return rows[: evaluation.max_examples] if evaluation.max_examples else rows


def eval_execute(*, eval_id: str) -> str:
    """Run a queued eval to its end; returns its outcome. Whatever goes wrong fails the eval
    with the reason: it never stays running."""
    evaluation = (
        Eval.objects.select_related("run", "dataset", "checkpoint").filter(pk=eval_id).first()
    )
    if evaluation is None or evaluation.status != Eval.Status.QUEUED:
        return "skipped"  # deleted, or a duplicate delivery of the task
    try:
        rows = eval_rows(evaluation)
    except (OSError, ValueError) as exc:
        eval_start(evaluation=evaluation, total=0)
        eval_fail(evaluation=evaluation, error=f"The dataset could not be read: {exc}")
        return "failed"
    if not eval_start(evaluation=evaluation, total=len(rows)):
        return "skipped"
    try:
        return _execute(evaluation, rows)
    except Exception as exc:
        logger.exception("eval %s failed", eval_id)
        eval_fail(evaluation=evaluation, error=f"{type(exc).__name__}: {exc}")
        return "failed"


def _heartbeat(evaluation: Eval, ended: threading.Event) -> None:
    """Mark ``evaluation`` alive every ``EVAL_HEARTBEAT_S`` until ``ended`` (a thread)."""
    try:
        while not ended.wait(settings.EVAL_HEARTBEAT_S):
            try:
                eval_heartbeat(evaluation=evaluation)
            except Exception:  # the database away for a moment: the next beat tries again
                logger.warning("eval %s: heartbeat not written", evaluation.pk, exc_info=True)
    finally:
        connection.close()  # this thread's own connection


def _execute(evaluation: Eval, rows: list[dict]) -> str:
    eval_id = evaluation.pk
    run = evaluation.run
    _, refused = run_sourced(run=run)  # the run's model and reward code, under today's rules
    if refused:
        eval_fail(evaluation=evaluation, error=errors_text(refused))
        return "failed"
    if not rows:
        eval_fail(evaluation=evaluation, error="There are no rows to evaluate.")
        return "failed"
    model = evaluation.checkpoint.path if evaluation.checkpoint else run.base_model
    if evaluation.checkpoint and not Path(model).is_dir():
        eval_fail(evaluation=evaluation, error=f"The checkpoint's files are gone ({model}).")
        return "failed"
    folder = eval_dir(evaluation)
    folder.mkdir(parents=True, exist_ok=True)
    rows_file, out = folder / "rows.jsonl", folder / "results.jsonl"
    rows_file.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    command = [
        sys.executable, "-m", "rl_core.evaluate", str(model), str(rows_file), str(out),
        "--tokenizer", run.base_model,
        "--reward", json.dumps(stored_setting(run.config, "reward")),
        "--k", str(evaluation.k),
        "--max-new-tokens", str(evaluation.max_new_tokens),
        "--temperature", str(evaluation.temperature),
        "--top-p", str(evaluation.top_p),
        "--seed", str(stored_setting(run.config, "seed")),
        # --engine from STEEP_EVAL_ENGINE (auto: a server of the run's backend where CUDA is)
        "--backend", str(stored_setting(run.config, "inference_backend")),
        "--parent-pid", str(os.getpid()),  # it ends with this worker, never writes beside a retry
    ]  # fmt: skip
    env = child_environment(os.environ) | {"STEEP_TORCH_THREADS": str(settings.STEEP_TORCH_THREADS)}
    with open(folder / "stderr.log", "w+") as errors:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env
        )
        watchdog = threading.Timer(EVAL_TIMEOUT.total_seconds(), process.kill)
        watchdog.start()
        ended = threading.Event()  # set: the evaluator exited, the heartbeat stops
        threading.Thread(target=_heartbeat, args=(evaluation, ended), daemon=True).start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                parts = line.split()
                if len(parts) == 3 and parts[0] == "progress" and parts[1].isdigit():
                    eval_progress(evaluation=evaluation, done=int(parts[1]))
            code = process.wait()
        finally:
            watchdog.cancel()
            ended.set()
        errors.seek(0)
        tail = errors.read()[-ERROR_TAIL_CHARS:].strip()
    if code != 0:
        logger.warning("eval %s failed: %s", eval_id, tail)
        eval_fail(evaluation=evaluation, error=tail or f"The evaluator exited with {code}.")
        return "failed"
    eval_finish(evaluation=evaluation, results=read_results(out))
    return "done"
