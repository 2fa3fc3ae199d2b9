"""The pools app's Celery tasks: each takes an id and calls one service in ``launching``."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import worker_ready

from webapp.pools import launching

logger = logging.getLogger(__name__)


@shared_task(name="pools.launch")
def pool_launch(pool_id: str) -> str:
    return launching.pool_launch(pool_id=pool_id)


@shared_task(name="pools.shutdown")
def pool_shutdown(pool_id: str, grace_s: float = 60.0) -> str:
    return launching.pool_shutdown(pool_id=pool_id, grace_s=grace_s)


@shared_task(name="pools.reconcile")
def pools_reconcile() -> dict:
    return launching.pools_reconcile()


@worker_ready.connect
def pools_resume_at_start(**_) -> None:
    """Pools interrupted by a clean stop of Steep start again with a worker."""
    resumed = launching.pools_resume()
    if resumed:
        logger.info("starting %d interrupted pool(s): %s", len(resumed), ", ".join(resumed))
