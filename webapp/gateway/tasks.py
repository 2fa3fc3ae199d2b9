"""The gateway's Celery tasks (``celery -A workers worker -B`` finds them; the beat schedule
names them in ``CELERY_BEAT_SCHEDULE``)."""

from __future__ import annotations

from celery import shared_task

from webapp.gateway import admission, services


@shared_task(name="sessions.expire_idle")
def sessions_expire_idle() -> int:
    """Close agent sessions idle past SESSION_IDLE_TIMEOUT_S (kept as expired, not trained unless configured)."""
    expired = services.sessions_expire_idle()
    admission.refresh_active_runs()  # slots of sessions deleted with their agent come back
    return expired
