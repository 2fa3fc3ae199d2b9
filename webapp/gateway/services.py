"""The gateway's writes made through the ORM: idle sessions expired, trajectories claimed,
inference servers registered and taken in and out of rotation.

An agent's own calls write through lane operations (``turns``, ``episodes``); every change
of a session's state, here too, is a ``webapp.gateway.lifecycle`` operation. All functions
are synchronous and commit before they return.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from webapp.gateway import lifecycle
from webapp.gateway.models import InferenceServer, Session
from webapp.runs.models import Run

S = Session.Status


# --- Sessions (their moves are ``webapp.gateway.lifecycle``'s) -------------------------------


def sessions_expire_idle(*, now=None) -> int:
    """Close sessions idle longer than SESSION_IDLE_TIMEOUT_S as expired (kept; trained only if configured)."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.SESSION_IDLE_TIMEOUT_S)
    count = 0
    for session_id in Session.objects.filter(
        status=S.OPEN, last_activity_at__lt=cutoff
    ).values_list("pk", flat=True):
        with transaction.atomic(), connection.cursor() as cursor:
            if lifecycle.end(cursor, session_id, status=S.EXPIRED, idle_before=cutoff):
                count += 1
    return count


def trajectories_claim(*, run: Run, limit: int, token: str = "") -> list[Session]:
    """Claim up to ``limit`` ready sessions of ``run`` for the trainer, oldest first
    (``lifecycle.claim``: concurrent claimers never get the same session; a retried claim,
    same ``token``, gets what it claimed)."""
    with transaction.atomic(), connection.cursor() as cursor:
        ids = lifecycle.claim(cursor, run_id=run.pk, limit=limit, token=token)
    sessions = Session.objects.in_bulk(ids)
    return [sessions[session_id] for session_id in ids]


# --- Inference servers ---------------------------------------------------------------------


def inference_server_register(*, run: Run, url: str, backend: str = "external") -> InferenceServer:
    server, _ = InferenceServer.objects.update_or_create(
        run=run,
        url=url.rstrip("/"),
        defaults={"backend": backend, "healthy": True, "unhealthy_until": None, "failures": 0},
    )
    return server


def inference_server_unregister(*, run: Run, url: str) -> None:
    InferenceServer.objects.filter(run=run, url=url.rstrip("/")).delete()


def inference_server_mark_down(*, run_id, url: str) -> None:
    """Take a server out of rotation for a while; it comes back on its own after the back-off."""
    server = InferenceServer.objects.filter(run_id=run_id, url=url).first()
    if server is None:
        return
    server.failures += 1
    server.healthy = False
    server.unhealthy_until = timezone.now() + timedelta(seconds=min(60, 2**server.failures))
    server.save(update_fields=["failures", "healthy", "unhealthy_until"])


def inference_server_mark_up(*, run_id, url: str) -> None:
    InferenceServer.objects.filter(run_id=run_id, url=url, healthy=False).update(
        healthy=True, unhealthy_until=None, failures=0
    )
