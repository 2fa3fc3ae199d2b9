"""A run's ledger: what happened to every trajectory it accepted, in numbers anyone can check.

``run_ledger(run)`` (``GET /api/v1/runs/<id>/ledger/``, and a line on the run page) counts the
run's sessions by where their trajectory is now. After a crash and a resume it reads the
surviving lineage: what was trained after the checkpoint the run resumed from is ready again
(``webapp.gateway.lifecycle.rewind``), so it counts as pending, not trained.

- ``accepted``: trajectories that went to training: ready, claimed, trained or dropped.
- ``trained``: trained into a policy version of the surviving lineage; ``trained_by_step``
  splits them by the step that trained them (step N produces version N).
- ``dropped``: not trained, with why (``dropped_by_reason``; ``stale``: no token fresh enough).
- ``pending``: ``ready`` (waiting for the trainer) + ``claimed`` (in the trainer's hands).
- Outside ``accepted``: ``open`` (sessions still running), ``unrewarded`` (ended without a
  reward), ``aborted`` (expired: the client went away without ending the session, and no
  reward took it to training).
- ``trained_twice``: sessions with more than one training record in the lineage.

``balanced`` is ``accepted == trained + dropped + pending and not trained_twice``, and the
training records agree with the states (``trained_records == trained``). ``accepted`` is
counted on its own (sessions neither open nor unrewarded), so a session in a state the
ledger does not know, a record without its move or a move without its record unbalances it.
Counts are read in one transaction; on a live run they are a moment's picture.

The run page polls its status line every 3 s; ``run_ledger_for_page`` serves it a ledger at
most about ten times its own cost old (0.4 s for 100,000 trained sessions on SQLite: one
ledger every 4 s at most, per web process) and says as of when. A cheap ledger (under 50 ms)
is always fresh; the REST ledger is always computed.
"""

from __future__ import annotations

import time

from django.core.cache import cache
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from webapp.gateway.lifecycle import DROP_STALE
from webapp.gateway.models import Session, TrainingRecord
from webapp.runs.models import Run

S, T = Session.Status, Session.Trajectory


def run_ledger(run: Run) -> dict:
    """The run's ledger as JSON-ready data (keys as in the module docstring)."""
    with transaction.atomic():
        return _ledger(run)


CACHE_ABOVE_S = 0.05  # a ledger cheaper than this is recomputed at every poll
CACHE_COST_FACTOR = 10  # else it is kept for this many times what it cost


def run_ledger_for_page(run: Run) -> dict:
    """``run_ledger`` for the run page's polled status line (see the module docstring): a
    kept one carries ``as_of``, the time it was read."""
    key = f"steep:ledger:{run.id}"
    kept = cache.get(key)
    if kept is not None:
        return kept
    started = time.perf_counter()
    ledger = run_ledger(run)
    cost = time.perf_counter() - started
    if cost >= CACHE_ABOVE_S:
        ledger["as_of"] = timezone.now()
        cache.set(key, ledger, timeout=CACHE_COST_FACTOR * cost)
    return ledger


def _ledger(run: Run) -> dict:
    sessions = Session.objects.filter(run=run)
    by_state: dict[tuple[str, str], int] = {
        (row["status"], row["trajectory"]): row["n"]
        for row in sessions.values("status", "trajectory").annotate(n=Count("id")).order_by()
    }

    def count(trajectory: str, status: str | None = None) -> int:
        return sum(n for (s, t), n in by_state.items() if t == trajectory and status in (None, s))

    trained, dropped = count(T.TRAINED), count(T.DROPPED)
    pending = count(T.READY) + count(T.CLAIMED)
    dropped_by_reason: dict[str, int] = {}
    for row in (
        sessions.filter(trajectory=T.DROPPED)
        .values("drop_reason")
        .annotate(n=Count("id"))
        .order_by()
    ):
        reason = row["drop_reason"] or DROP_STALE
        dropped_by_reason[reason] = dropped_by_reason.get(reason, 0) + row["n"]
    records = TrainingRecord.objects.filter(run=run)
    trained_by_step = [
        {"step": row["version"], "count": row["n"]}
        for row in records.values("version").annotate(n=Count("id")).order_by("version")
    ]
    twice = (
        records.values("session_id")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .order_by("session_id")
        .values_list("session_id", flat=True)
    )
    trained_twice = [str(session_id) for session_id in twice]
    accepted = sessions.exclude(trajectory__in=[T.PENDING, T.UNREWARDED]).count()
    recorded = sum(row["count"] for row in trained_by_step)
    return {
        "run": str(run.id),
        "version": run.weight_version,
        "step": run.step,
        "accepted": accepted,
        "trained": trained,
        "trained_by_step": trained_by_step,
        "dropped": dropped,
        "dropped_by_reason": dropped_by_reason,
        "pending": pending,
        "ready": count(T.READY),
        "claimed": count(T.CLAIMED),
        "open": count(T.PENDING),
        "unrewarded": count(T.UNREWARDED, S.ENDED),
        "aborted": count(T.UNREWARDED, S.EXPIRED),
        "trained_twice": trained_twice,
        "trained_records": recorded,
        "balanced": not trained_twice
        and trained == recorded
        and accepted == trained + dropped + pending,
    }
