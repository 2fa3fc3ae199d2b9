"""The pools app's Celery tasks: each takes an id and calls one service in ``launching``."""

from __future__ import annotations

from celery import shared_task

from webapp.pools import launching


@shared_task(name="pools.launch")
def pool_launch(pool_id: str) -> str:
    return launching.pool_launch(pool_id=pool_id)


@shared_task(name="pools.shutdown")
def pool_shutdown(pool_id: str, grace_s: float = 60.0) -> str:
    return launching.pool_shutdown(pool_id=pool_id, grace_s=grace_s)
