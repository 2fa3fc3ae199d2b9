"""Staleness admission across web processes: one conditional UPDATE on the run's counters.

``Run.sessions_open`` (rollouts running) and ``Run.sessions_accepted`` (trajectories
handed to training: ready, claimed or trained) are the ``running`` and ``accepted`` of
AReaL's rule (``rl_core.staleness``). A new session is admitted by one statement that
increments ``sessions_open`` only while::

    sessions_open + sessions_accepted < (max_staleness + weight_version + 1) * batch_size

(and ``sessions_open < max_concurrent_rollouts``, ``sessions_accepted < (weight_version + 1 +
max_queued_batches) * batch_size`` when those are set), so two web processes
can never both take the last slot, and admission costs the same however many sessions
the run has. Every other change of the counters is a session changing state, made by
``webapp.gateway.lifecycle``; ``refresh`` recomputes them from the sessions, which the
reconciler runs periodically so that sessions deleted with their agent give their slots
back. (A one-turn completion holds its slot from admission but writes its session row
only with its answer, so a refresh during that request under-counts it by one until the
next.)

The functions take a DB-API cursor (Django's, on either backend) so that the ORM
services and the gateway's write lane share them.
"""

from __future__ import annotations

from django.db import connection

from rl_core.staleness import StalenessBudget
from webapp.gateway import sql
from webapp.pools.models import Pool
from webapp.runs.models import Run

ACCEPTED = ("ready", "claimed", "trained")  # Session.Trajectory values that hold a slot

RUN_TABLE = Run._meta.db_table
POOL_TABLE = Pool._meta.db_table


def run_pk(cursor, run_id):
    """``run_id`` as the database stores it (a hex string on SQLite, a UUID on Postgres)."""
    return Run._meta.pk.get_db_prep_value(run_id, cursor.db)


def budget(config: dict) -> StalenessBudget:
    """``(max_staleness, batch_size, max_concurrent_rollouts, max_queued_batches)`` of a run
    config, with RunConfig's defaults."""
    return StalenessBudget.from_config(config)


def refused_bucket(run_id) -> str:
    """The ``webapp.ratelimit`` window counting a run's 429s for a full staleness budget."""
    return f"refused:{run_id}"


def admit(cursor, *, run_id, config: dict) -> bool:
    """Open one rollout slot on a running run if its staleness budget allows (and, for a run
    on a shared pool, the pool's ``max_sessions_per_run``); True when admitted."""
    max_staleness, batch_size, max_concurrent, queued = budget(config)
    params = [run_pk(cursor, run_id), max_staleness, batch_size, max_concurrent, max_concurrent]
    params += [queued, queued, batch_size]
    pool_clause = ""
    if pool := config.get("inference_pool"):
        # 0 (no limit) becomes NULL, and then a bound the count is always under.
        pool_clause = (
            f" AND sessions_open < COALESCE((SELECT NULLIF(max_sessions_per_run, 0)"
            f" FROM {POOL_TABLE} WHERE name = %s), sessions_open + 1)"
        )
        params.append(pool)
    admitted = sql.changed_rows(
        cursor,
        f"UPDATE {RUN_TABLE} SET sessions_open = sessions_open + 1"
        " WHERE id = %s AND status = 'running'"
        " AND sessions_open + sessions_accepted < (%s + weight_version + 1) * %s"
        " AND (%s = 0 OR sessions_open < %s)"
        " AND (%s = 0 OR sessions_accepted < (weight_version + 1 + %s) * %s)" + pool_clause,
        params,
    )
    return admitted == 1


def pool_session_limit(cursor, config: dict) -> int:
    """The ``max_sessions_per_run`` of the pool the run is on (0: none, or no pool)."""
    if not (pool := config.get("inference_pool")):
        return 0
    cursor.execute(f"SELECT max_sessions_per_run FROM {POOL_TABLE} WHERE name = %s", [pool])
    row = cursor.fetchone()
    return int(row[0]) if row else 0


def refresh(cursor, run_id) -> None:
    """Recompute a run's counters from its sessions, in one statement."""
    from webapp.gateway.models import Session

    sessions = Session._meta.db_table
    marks = ", ".join(["%s"] * len(ACCEPTED))
    pk = run_pk(cursor, run_id)
    cursor.execute(
        f"UPDATE {RUN_TABLE} SET"
        f" sessions_open = (SELECT COUNT(*) FROM {sessions} WHERE run_id = %s AND status = 'open'),"
        f" sessions_accepted = (SELECT COUNT(*) FROM {sessions} WHERE run_id = %s AND trajectory IN ({marks}))"
        " WHERE id = %s",
        [pk, pk, *ACCEPTED, pk],
    )


def refresh_active_runs() -> int:
    """``refresh`` every starting, running or stopping run; returns how many."""
    ids = list(
        Run.objects.filter(status__in=("starting", "running", "stopping")).values_list(
            "pk", flat=True
        )
    )
    with connection.cursor() as cursor:
        for run_id in ids:
            refresh(cursor, run_id)
    return len(ids)
