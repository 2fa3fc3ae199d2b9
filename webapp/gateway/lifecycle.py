"""Sessions and their trajectories: every change of state, and the run's counters with it.

A session's state is its ``status`` and its trajectory's training state. The legal moves::

    status       open ──► ended | expired                       (both final)
    trajectory   pending ──► ready | unrewarded                 (as the session leaves open)
                 unrewarded ──► ready                           (rewarded late: a one-turn
                                                                 completion, a judge, a person)
                 unrewarded ──► dropped                         (a human reward never came)
                 ready ──► claimed ──► trained | dropped        (the trainer's)
                           claimed ──► ready                    (released: its job ended first)
                 trained ──► ready                              (rewound: trained after the
                                                                 checkpoint a run resumed from)

A session is written ``open``/``pending`` (the gateway) or ``ended``/``ready`` (a dataset
run's episode). Nothing else moves a session: ``test_session_lifecycle_has_one_home``
fails on a status write anywhere else.

The run's admission counters (``webapp.gateway.admission``) follow from the states: a
session holds a running slot while ``open`` and an accepted slot while its trajectory is
ready, claimed or trained. Each move applies the difference of its two states in the same
transaction, so the counters are exact without healing; opening takes its slot through
admission's conditional increment before the row is written (``admit``), and a one-turn
completion whose row was never written gives it back (``give_back``). The reconciler's
``admission.refresh`` remains for sessions deleted with their agent.

Every operation is a function of a DB-API cursor with hand-written SQL, so the gateway's
lane (``webapp.gateway.lane``) and the ORM callers (services, the internal API, Celery
tasks, inside ``transaction.atomic()``) run the same code.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.utils import timezone

from rl_core.config import stored_setting
from webapp.gateway import admission, sql
from webapp.gateway.errors import GatewayError
from webapp.gateway.models import Interaction, Session, TrainingRecord
from webapp.runs.models import Run

S, T = Session.Status, Session.Trajectory

STATUS_MOVES: dict[str, set[str]] = {
    S.OPEN: {S.ENDED, S.EXPIRED},
    S.ENDED: set(),
    S.EXPIRED: set(),
}
TRAJECTORY_MOVES: dict[str, set[str]] = {
    T.PENDING: {T.READY, T.UNREWARDED},
    T.UNREWARDED: {T.READY, T.DROPPED},
    T.READY: {T.CLAIMED},
    T.CLAIMED: {T.READY, T.TRAINED, T.DROPPED},
    T.TRAINED: {T.READY},
    T.DROPPED: set(),
}

# A run in one of these has released its claims for good (``webapp.runs.jobs.job_report_status``).
_R = Run.Status
UNCLAIMABLE_RUN_STATUSES = (_R.COMPLETED, _R.FAILED, _R.STOPPED, _R.INTERRUPTED)

_SESSIONS, _INTERACTIONS = Session._meta.db_table, Interaction._meta.db_table
_RECORDS = TrainingRecord._meta.db_table
# Why a trajectory was dropped (``Session.drop_reason``): no token within ``max_staleness``;
# its only turn was aborted (a streamed one-turn completion whose client went away); its human
# reward did not come in time.
DROP_STALE, DROP_ABORTED, DROP_HUMAN_TIMEOUT = "stale", "aborted", "human_timeout"


@dataclasses.dataclass(frozen=True)
class State:
    status: str
    trajectory: str

    def __str__(self) -> str:
        return f"{self.status}/{self.trajectory}"

    @property
    def slots(self) -> tuple[int, int]:
        """``(running, accepted)``: what this state holds of the run's admission counters."""
        return int(self.status == S.OPEN), int(self.trajectory in admission.ACCEPTED)


def valid(state: State) -> bool:
    """A trajectory is pending exactly while its session is open."""
    return (state.status == S.OPEN) == (state.trajectory == T.PENDING)


def allowed(current: State, target: State) -> bool:
    """Whether the table allows ``current`` → ``target``."""
    if current == target or not (valid(current) and valid(target)):
        return False
    status_ok = target.status == current.status or target.status in STATUS_MOVES[current.status]
    trajectory_ok = (
        target.trajectory == current.trajectory
        or target.trajectory in TRAJECTORY_MOVES[current.trajectory]
    )
    return status_ok and trajectory_ok


class IllegalMove(GatewayError):
    """A move the table does not allow: 410 for an expired session, 409 otherwise."""

    def __init__(self, session_id, current: State, target: State):
        statuses = ", ".join(sorted(STATUS_MOVES[current.status])) or "nothing (final)"
        trajectories = ", ".join(sorted(TRAJECTORY_MOVES[current.trajectory])) or "nothing (final)"
        expired = current.status == S.EXPIRED
        super().__init__(
            410 if expired else 409,
            f"Session {session_id} is {current}; it cannot become {target}. From"
            f" {current.status} a session can become: {statuses}; from {current.trajectory} its"
            f" trajectory can become: {trajectories}.",
            code="session_expired" if expired else "session_ended",
        )
        self.current, self.target = current, target


def _count(cursor, run_id, current: State | None, target: State | None, times: int = 1) -> None:
    """Move the run's counters by what ``times`` sessions going ``current`` → ``target``
    change (None: no session, before it is written or after it is gone)."""
    before = current.slots if current is not None else (0, 0)
    after = target.slots if target is not None else (0, 0)
    running = (after[0] - before[0]) * times
    accepted = (after[1] - before[1]) * times
    if run_id is None or not (running or accepted):
        return
    cursor.execute(
        f"UPDATE {admission.RUN_TABLE} SET sessions_open = sessions_open + %s,"
        " sessions_accepted = sessions_accepted + %s WHERE id = %s",
        [running, accepted, admission.run_pk(cursor, run_id)],
    )


# --- Opening -------------------------------------------------------------------------------


def admit(cursor, *, run_id, config: dict) -> bool:
    """Take a running slot for a session about to open, if the staleness budget allows."""
    return admission.admit(cursor, run_id=run_id, config=config)


def insert_open(cursor, row: dict[str, Any]) -> None:
    """Write an admitted session (its slot is already taken): ``open``/``pending``.

    ``row`` maps Session fields to values; status and trajectory are set here.
    """
    sql.insert(cursor, Session, row | {"status": S.OPEN, "trajectory": T.PENDING})


def give_back(cursor, *, run_id, session_id) -> None:
    """Return the slot of an admitted session whose row was never written (a one-turn
    completion that failed). If the row exists after all, the session holds the slot."""
    cursor.execute(
        f"SELECT 1 FROM {_SESSIONS} WHERE id = %s", [sql.pk(cursor, Session, session_id)]
    )
    if cursor.fetchone() is None:
        _count(cursor, run_id, State(S.OPEN, T.PENDING), None)


def insert_finished(cursor, *, run_id, rows: list[dict[str, Any]], rewarded: bool = True) -> None:
    """Write sessions that are over (a dataset run's episodes): ready to train, or
    unrewarded until the web app scores them (``rewarded=False``: a judge or human reward)."""
    target = State(S.ENDED, T.READY if rewarded else T.UNREWARDED)
    for row in rows:
        sql.insert(
            cursor, Session, row | {"status": target.status, "trajectory": target.trajectory}
        )
    _count(cursor, run_id, None, target, times=len(rows))


# --- One session ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ended:
    session_id: uuid.UUID
    state: State
    interaction_count: int


def end(cursor, session_id, *, status: str = S.ENDED, idle_before: datetime | None = None):
    """End an open session (``status`` ended, or expired by the idle timeout).

    Its trajectory goes to training (ready) when a turn was rewarded and the session
    ended, or expired under ``train_incomplete_sessions``; otherwise it is unrewarded.
    Locks the row. Raises ``IllegalMove`` when the session is no longer open; with
    ``idle_before``, returns None instead when it was not idle since then.
    """
    session_pk = sql.pk(cursor, Session, session_id)
    cursor.execute(
        f"SELECT s.status, s.trajectory, s.run_id, s.interaction_count, s.last_activity_at,"
        f" r.config, EXISTS (SELECT 1 FROM {_INTERACTIONS} i"
        "  WHERE i.session_id = s.id AND i.reward IS NOT NULL)"
        f" FROM {_SESSIONS} s LEFT JOIN {admission.RUN_TABLE} r ON r.id = s.run_id"
        f" WHERE s.id = %s{sql.for_update(cursor, of='s')}",
        [session_pk],
    )
    row = cursor.fetchone()
    if row is None:
        raise GatewayError(404, f"Session {session_id} not found.", code="session_not_found")
    current = State(row[0], row[1])
    if idle_before is not None and (
        current.status != S.OPEN or sql.as_datetime(row[4]) >= idle_before
    ):
        return None
    rewarded = bool(row[6])
    config = sql.loads(row[5]) if row[5] is not None else {}
    train = rewarded and (
        status == S.ENDED or row[2] is None or stored_setting(config, "train_incomplete_sessions")
    )
    target = State(status, T.READY if train else T.UNREWARDED)
    if current.status != S.OPEN or not allowed(current, target):
        raise IllegalMove(session_id, current, target)
    cursor.execute(
        f"UPDATE {_SESSIONS} SET status = %s, trajectory = %s, ended_at = %s WHERE id = %s",
        [
            target.status,
            target.trajectory,
            sql.value(cursor, Session, "ended_at", timezone.now()),
            session_pk,
        ],
    )
    _count(cursor, row[2], current, target)
    return Ended(sql.as_uuid(session_id), target, int(row[3]))


def rewarded_after_end(cursor, session_id) -> bool:
    """An ended, unrewarded session got its first reward: it goes to training (ready).
    False (and nothing changes) when its trajectory was not unrewarded."""
    current, target = State(S.ENDED, T.UNREWARDED), State(S.ENDED, T.READY)
    cursor.execute(
        f"SELECT run_id FROM {_SESSIONS} WHERE id = %s AND status = %s AND trajectory = %s",
        [sql.pk(cursor, Session, session_id), current.status, current.trajectory],
    )
    row = cursor.fetchone()
    if row is None:
        return False
    moved = sql.changed_rows(
        cursor,
        f"UPDATE {_SESSIONS} SET trajectory = %s WHERE id = %s AND trajectory = %s",
        [target.trajectory, sql.pk(cursor, Session, session_id), current.trajectory],
    )
    _count(cursor, row[0], current, target, times=moved)
    return moved == 1


def drop_unrewarded(cursor, session_id, *, reason: str) -> bool:
    """An ended session that will not be rewarded (a human reward's timeout; an aborted
    one-turn completion) is dropped with ``reason``: never trained, and counted as such.
    False (and nothing changes) when it was not unrewarded."""
    moved = sql.changed_rows(
        cursor,
        f"UPDATE {_SESSIONS} SET trajectory = %s, drop_reason = %s"
        " WHERE id = %s AND status = %s AND trajectory = %s",
        [T.DROPPED, reason, sql.pk(cursor, Session, session_id), S.ENDED, T.UNREWARDED],
    )
    # Neither state holds an admission slot: no counter moves.
    return moved == 1


# --- The trainer's moves, many sessions at a time -------------------------------------------


def _move_many(
    cursor,
    *,
    run_id,
    session_ids: Iterable | None,
    current: str,
    target: str,
    also: dict[str, Any] | None = None,
) -> int:
    """Move the run's sessions whose trajectory is ``current`` (all of them, or those of
    ``session_ids``) to ``target``; returns how many moved. Sessions in another state stay."""
    assert target in TRAJECTORY_MOVES[current], f"{current} → {target} is not in the table"
    also = also or {}
    sets = ", ".join(["trajectory = %s", *(f"{name} = %s" for name in also)])
    values = [target, *(sql.value(cursor, Session, name, raw) for name, raw in also.items())]
    where = f"UPDATE {_SESSIONS} SET {sets} WHERE run_id = %s AND trajectory = %s"
    run_pk = admission.run_pk(cursor, run_id)
    if session_ids is None:
        moved = sql.changed_rows(cursor, where, [*values, run_pk, current])
    else:
        moved = 0
        for chunk in sql.chunks([sql.pk(cursor, Session, sid) for sid in session_ids]):
            moved += sql.changed_rows(
                cursor,
                f"{where} AND id IN ({sql.marks(len(chunk))})",
                [*values, run_pk, current, *chunk],
            )
    # Every session of a trajectory state holds the same slots, whatever its status.
    _count(cursor, run_id, State(S.ENDED, current), State(S.ENDED, target), times=moved)
    return moved


def claim(cursor, *, run_id, limit: int, token: str = "") -> list[uuid.UUID]:
    """Claim up to ``limit`` ready sessions of the run for the trainer, oldest first.

    ``token`` (the job's id for this claim, kept across its retries): when sessions are still
    claimed under it, the claim was made and its answer lost (the web process died after the
    commit), and they are the answer again; without this they would stay claimed, untrained,
    until the job ended.

    Concurrent claimers never get the same session: PostgreSQL skips rows another
    claimer has locked; SQLite serialises write transactions. A run that has ended
    (completed, failed, stopped, interrupted) gives nothing: its end released what was
    claimed, and a claim still waiting (a long-poll) must not take a session that ends after
    it. The run's row is locked first, so the end's status change and release either come
    before this claim (and it sees the status) or after it (and release what it took).
    """
    cursor.execute(
        f"SELECT status FROM {admission.RUN_TABLE} WHERE id = %s{sql.for_update(cursor)}",
        [admission.run_pk(cursor, run_id)],
    )
    row = cursor.fetchone()
    if row is None or row[0] in UNCLAIMABLE_RUN_STATUSES:
        return []
    if token:
        cursor.execute(
            f"SELECT id FROM {_SESSIONS} WHERE run_id = %s AND trajectory = %s"
            " AND claim_token = %s ORDER BY ended_at, created_at",
            [admission.run_pk(cursor, run_id), T.CLAIMED, token],
        )
        replay = [sql.as_uuid(row[0]) for row in cursor.fetchall()]
        if replay:
            return replay
    cursor.execute(
        f"SELECT id FROM {_SESSIONS} WHERE run_id = %s AND trajectory = %s"
        f" ORDER BY ended_at, created_at LIMIT %s{sql.for_update(cursor, skip_locked=True)}",
        [admission.run_pk(cursor, run_id), T.READY, limit],
    )
    ids = [sql.as_uuid(row[0]) for row in cursor.fetchall()]
    if ids:
        _move_many(
            cursor,
            run_id=run_id,
            session_ids=ids,
            current=T.READY,
            target=T.CLAIMED,
            also={"claimed_at": timezone.now(), "claim_token": token[:64]},
        )
    return ids


def release(cursor, *, run_id, session_ids: Iterable | None = None) -> int:
    """Claimed but untrained sessions go back to ready (all of the run's when no ids: its job
    ended before training them)."""
    return _move_many(
        cursor,
        run_id=run_id,
        session_ids=session_ids,
        current=T.CLAIMED,
        target=T.READY,
        also={"claimed_at": None},
    )


def finish_training(
    cursor, *, run_id, version: int, trained: Iterable, dropped: Iterable, reason: str = DROP_STALE
) -> tuple[int, int]:
    """Claimed sessions were trained into policy ``version`` (also those whose stale early
    turns were masked out of the loss), or dropped with nothing fresh enough to train
    (a dropped trajectory gives its accepted slot back; ``reason`` says why). Each session
    that moves to trained gets its ``TrainingRecord``; one reported again (a retried
    request) is not claimed any more and moves nowhere. Returns ``(trained, dropped)``."""
    trained_ids = _claimed(cursor, run_id=run_id, session_ids=list(trained))
    moved = _move_many(
        cursor,
        run_id=run_id,
        session_ids=trained_ids,
        current=T.CLAIMED,
        target=T.TRAINED,
        also={"trained_version": version},
    )
    now = timezone.now()
    for session_id in trained_ids:
        sql.insert(
            cursor,
            TrainingRecord,
            {"run": run_id, "session": session_id, "version": version, "created_at": now},
        )
    return (
        moved,
        _move_many(
            cursor,
            run_id=run_id,
            session_ids=list(dropped),
            current=T.CLAIMED,
            target=T.DROPPED,
            also={"trained_version": version, "drop_reason": reason},
        ),
    )


def _claimed(cursor, *, run_id, session_ids: list) -> list[uuid.UUID]:
    """Those of ``session_ids`` that are the run's and claimed, locked until the transaction ends."""
    found: list[uuid.UUID] = []
    run_pk = admission.run_pk(cursor, run_id)
    for chunk in sql.chunks([sql.pk(cursor, Session, sid) for sid in session_ids]):
        cursor.execute(
            f"SELECT id FROM {_SESSIONS} WHERE run_id = %s AND trajectory = %s"
            f" AND id IN ({sql.marks(len(chunk))}){sql.for_update(cursor)}",
            [run_pk, T.CLAIMED, *chunk],
        )
        found.extend(sql.as_uuid(row[0]) for row in cursor.fetchall())
    return found


def rewind(cursor, *, run_id, version: int) -> int:
    """The run resumed from a checkpoint of policy ``version``: what was trained into a later
    version never happened in the surviving lineage, so those sessions are ready again (to
    be trained once more) and their records go. Sessions trained at or before ``version``,
    and drops (a decision, not training), stay. Returns how many sessions were rewound."""
    run_pk = admission.run_pk(cursor, run_id)
    cursor.execute(
        f"SELECT id FROM {_SESSIONS} WHERE run_id = %s AND trajectory = %s"
        f" AND trained_version > %s{sql.for_update(cursor)}",
        [run_pk, T.TRAINED, version],
    )
    ids = [sql.as_uuid(row[0]) for row in cursor.fetchall()]
    cursor.execute(f"DELETE FROM {_RECORDS} WHERE run_id = %s AND version > %s", [run_pk, version])
    return _move_many(
        cursor,
        run_id=run_id,
        session_ids=ids,
        current=T.TRAINED,
        target=T.READY,
        also={"trained_version": None, "claimed_at": None},
    )
