"""The RL protocol's database work (start_session, set_reward, end_session) as lane operations.

Like ``turns`` for chat completions: each builder returns an *operation*, a function of a
DB-API cursor that runs in one transaction, on the ASGI fast route through the process's
lane (group commit) or on Django's route through ``lane.in_thread``, and returns the JSON
answer. Every move of a session is ``lifecycle``'s; authentication and the run checks are
``turns``'s.
"""

from __future__ import annotations

import contextlib
import uuid

from django.utils import timezone

from rl_core.ids import new_uuid
from webapp.accounts.keys import hash_key
from webapp.gateway import lifecycle, roles, sql, turns
from webapp.gateway.errors import GatewayError, bad_request
from webapp.gateway.models import Interaction, Session

S, T = Session.Status, Session.Trajectory
_SESSIONS, _INTERACTIONS = Session._meta.db_table, Interaction._meta.db_table


def start(*, token: str | None, agent_id, task_id: str, metadata: dict, new_key: str):
    """Admit and open a session for the agent's run; answers ``{"session_id", "api_key"}``.

    With a project key the session gets ``new_key``. With the key of a live session, that
    session ends and its key moves onto the new one (the agent keeps its key across
    episodes); if the new one cannot be admitted, the old one stays open.
    """
    session_id = new_uuid()

    def operation(cursor) -> dict:
        caller = turns.identify(cursor, token=token, agent_id=agent_id)
        run = turns.serving(caller)
        replaces = caller.session_id
        if replaces is not None and caller.session_status != S.OPEN:
            expired = caller.session_status == S.EXPIRED  # 410 like every other call with this key
            raise GatewayError(
                410 if expired else 409,
                f"This session key's session has {'expired' if expired else 'ended'}; start new sessions with the project key.",
                code="session_expired" if expired else "session_ended",
            )
        key_hash = caller.key_hash if replaces is not None else hash_key(new_key)
        now = timezone.now()
        # Only a rebinding writes before it may refuse; a plain start needs no savepoint.
        with sql.all_or_nothing(cursor) if replaces is not None else contextlib.nullcontext():
            if replaces is not None:
                lifecycle.end(cursor, replaces)
                cursor.execute(
                    f"UPDATE {_SESSIONS} SET key_hash = NULL WHERE id = %s",
                    [sql.pk(cursor, Session, replaces)],
                )
            if not lifecycle.admit(cursor, run_id=run.id, config=run.config):
                raise turns.budget_full(cursor, run)
            lifecycle.insert_open(
                cursor,
                {
                    "id": session_id,
                    "project": caller.project_id,
                    "agent": caller.agent_id,
                    "run": run.id,
                    "key_hash": key_hash,
                    "one_turn": False,
                    "task_id": task_id,
                    "metadata": metadata,
                    "admitted_version": run.weight_version,
                    "interaction_count": 0,
                    "server_url": "",
                    "created_at": now,
                    "last_activity_at": now,
                },
            )
        return {"session_id": str(session_id), "api_key": token if replaces else new_key}

    return operation


def reward(
    *,
    token: str | None,
    agent_id,
    reward: float,
    interaction_id: str | None,
    hint: str | None = None,
    role: str | None = None,
):
    """Set a turn's reward (the last turn when no id, or with ``role`` the last turn of that
    role of a multi-agent run); answers ``{"interaction_id",
    "session_id", "reward"}``. Setting the same value again changes nothing.

    ``hint``: a correction in words for a self-distilling run (``rl_core.hints``), kept on the
    session until its trajectory goes to training (also beside a reward already set).

    With a project key an ``interaction_id`` is required: it names a one-turn completion of
    this agent, whose session then ends and goes to training.
    """

    def operation(cursor) -> dict:
        caller = turns.identify(cursor, token=token, agent_id=agent_id)
        if role is not None:
            _check_role(caller, role)
        session_id = caller.session_id
        if session_id is None:
            session_id = _one_turn_session(cursor, caller, interaction_id)
        session_pk = sql.pk(cursor, Session, session_id)
        status, trajectory, one_turn, turn_id, current, turn_role = _session_and_turn(
            cursor, session_pk, interaction_id, role
        )
        if status == S.EXPIRED:
            raise GatewayError(
                410,
                f"Session {session_id} expired; its rewards can no longer change.",
                code="session_expired",
            )
        if turn_id is None:
            _no_turn(interaction_id)
        if role is not None and interaction_id and turn_role != role:
            raise bad_request(
                f"Interaction {interaction_id} was played as role {turn_role!r}, not {role!r}; "
                "send the turn's own role, or leave 'role' out.",
                param="role",
                code="role_mismatch",
            )
        answer = {"interaction_id": turn_id, "session_id": str(session_id), "reward": reward}
        untrained = trajectory in (T.PENDING, T.READY, T.UNREWARDED)
        if hint is not None:
            answer["hint"] = hint
        if current == reward:
            if hint is not None and untrained:
                _set_hint(cursor, session_pk, hint)
            return answer
        if status == S.ENDED and not one_turn:
            raise GatewayError(
                409, f"Session {session_id} has ended; its rewards are final.", code="session_ended"
            )
        if one_turn and not untrained:
            raise GatewayError(
                409,
                "This completion has already gone to training; its reward is final.",
                code="session_ended",
            )
        now = timezone.now()
        cursor.execute(
            f"UPDATE {_INTERACTIONS} SET reward = %s, rewarded_at = %s WHERE id = %s",
            [reward, sql.value(cursor, Interaction, "rewarded_at", now), turn_id],
        )
        cursor.execute(
            f"UPDATE {_SESSIONS} SET last_activity_at = %s WHERE id = %s",
            [sql.value(cursor, Session, "last_activity_at", now), session_pk],
        )
        if hint is not None:
            _set_hint(cursor, session_pk, hint)
        if one_turn:
            if status == S.OPEN:
                lifecycle.end(cursor, session_id)
            else:
                lifecycle.rewarded_after_end(cursor, session_id)
        return answer

    return operation


def _set_hint(cursor, session_pk, hint: str) -> None:
    cursor.execute(f"UPDATE {_SESSIONS} SET hint = %s WHERE id = %s", [hint, session_pk])


def _one_turn_session(cursor, caller: turns.Caller, interaction_id: str | None) -> uuid.UUID:
    """The session of a completion made with the project key, named by its id."""
    if not interaction_id:
        raise GatewayError(
            400,
            "With a project key, set_reward needs 'interaction_id' (the completion's id).",
            param="interaction_id",
            code="missing_required_parameter",
        )
    cursor.execute(
        f"SELECT i.session_id FROM {_INTERACTIONS} i JOIN {_SESSIONS} s ON s.id = i.session_id"
        " WHERE i.id = %s AND s.agent_id = %s",
        [interaction_id, sql.pk(cursor, Session, caller.agent_id)],
    )
    row = cursor.fetchone()
    if row is None:
        raise GatewayError(
            404,
            f"Interaction {interaction_id} not found.",
            param="interaction_id",
            code="interaction_not_found",
        )
    return sql.as_uuid(row[0])


def _check_role(caller: turns.Caller, role: str) -> None:
    """A 400 unless ``role`` is one of the caller's run's roles."""
    run_roles = roles.run_roles(caller.run.config if caller.run is not None else None)
    if role in run_roles:
        return
    if not run_roles:
        raise bad_request(
            "'role' is for multi-agent runs; this agent's run trains one policy: leave it out.",
            param="role",
        )
    raise bad_request(
        f"'role' must be one of this run's roles: {', '.join(run_roles)}; got {role!r}.",
        param="role",
    )


def _session_and_turn(cursor, session_pk, interaction_id: str | None, role: str | None) -> tuple:
    """The session's status, trajectory and one_turn (locked), with ``(id, reward, role)`` of
    the turn to reward (the named one, else the last, of ``role`` when given; None when there
    is none), in one read."""
    if interaction_id:
        turn_clause, params = "i.id = %s", [interaction_id, session_pk]
    elif role:
        turn_clause = (
            f"i.turn = (SELECT MAX(turn) FROM {_INTERACTIONS}"
            " WHERE session_id = s.id AND role = %s)"
        )
        params = [role, session_pk]
    else:
        turn_clause = f"i.turn = (SELECT MAX(turn) FROM {_INTERACTIONS} WHERE session_id = s.id)"
        params = [session_pk]
    cursor.execute(
        f"SELECT s.status, s.trajectory, s.one_turn, i.id, i.reward, i.role FROM {_SESSIONS} s"
        f" LEFT JOIN {_INTERACTIONS} i ON i.session_id = s.id AND {turn_clause}"
        f" WHERE s.id = %s{sql.for_update(cursor, of='s')}",
        params,
    )
    return cursor.fetchone()


def _no_turn(interaction_id: str | None):
    if interaction_id:
        raise GatewayError(
            404,
            f"Interaction {interaction_id} not found in this session.",
            param="interaction_id",
            code="interaction_not_found",
        )
    raise GatewayError(409, "The session has no completion to reward yet.", code="no_interaction")


def end(*, token: str | None, agent_id):
    """End the session of a session key; answers ``{"session_id", "interaction_count",
    "trajectory"}`` (``lifecycle.end``: 409/410 when it is no longer open)."""

    def operation(cursor) -> dict:
        caller = turns.identify(cursor, token=token, agent_id=agent_id)
        if caller.session_id is None:
            raise bad_request(
                "end_session needs the session key returned by /rl/start_session as the bearer token.",
                code="session_key_required",
            )
        ended = lifecycle.end(cursor, caller.session_id)
        return {
            "session_id": str(ended.session_id),
            "interaction_count": ended.interaction_count,
            "trajectory": ended.state.trajectory,
        }

    return operation
