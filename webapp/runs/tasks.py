"""The runs app's Celery tasks (``celery -A workers worker -B`` finds them): each takes ids
and calls one service in ``webapp.runs.launching`` (or ``webapp.runs.exporting``). The
names are what the beat schedule (``CELERY_BEAT_SCHEDULE``) and the queue refer to; keep them."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import worker_ready

from webapp.runs import demo_agent, exporting, launching

logger = logging.getLogger(__name__)


@shared_task(name="runs.launch")
def run_launch(run_id: str) -> str:
    return launching.run_launch(run_id=run_id)


@shared_task(name="runs.shutdown")
def run_shutdown(run_id: str, grace_s: float = 120.0) -> str:
    return launching.run_shutdown(run_id=run_id, grace_s=grace_s)


@shared_task(name="runs.export_checkpoint")
def checkpoint_export(checkpoint_id: int) -> str:
    return exporting.checkpoint_export_execute(checkpoint_id=checkpoint_id)


@shared_task(name="runs.reconcile")
def runs_reconcile() -> dict:
    return launching.runs_reconcile()


@shared_task(name="runs.demo_agent")
def demo_agent_play() -> dict:
    return demo_agent.demo_agent_play()


@worker_ready.connect
def runs_resume_at_start(**_) -> None:
    """Runs interrupted by a clean stop of Steep resume when a worker starts again."""
    resumed = launching.runs_resume()
    if resumed:
        logger.info("resuming %d interrupted run(s): %s", len(resumed), ", ".join(resumed))
