"""The chat-completion hot path's database work, as lane operations (``webapp.gateway.lane``).

A completion touches the database twice:

1. ``begin(...)``: authenticate the bearer (project key or session key) for the agent,
   count it against the key's rate limit, check the agent's run is serving, then either
   load the session's last turn (token-exact continuation, retry dedup) or, for a
   project key, admit a one-turn session (``lifecycle.admit``);
2. ``record(...)``: store the turn (the interaction row; a one-turn session's row through
   ``lifecycle.insert_open``, or the open session's turn count) and
   return the response to send, which for a retry overlapping its original is the
   original's.

``discard`` gives back the admission slot of a one-turn completion that failed.
Each is a plain function of a DB-API cursor with hand-written SQL: the ORM's per-query
cost was most of the gateway's latency (docs/benchmarks/gateway.md). ``authenticate`` is also the
one implementation of the gateway's auth rules for the ORM services.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from rl_core.ids import new_uuid
from webapp import ratelimit
from webapp.accounts.keys import SESSION_KEY_PREFIX, hash_key
from webapp.accounts.models import APIKey
from webapp.accounts.services import LAST_USED_RESOLUTION
from webapp.agents.models import Agent
from webapp.gateway import admission, deltas, earlier_turns, lifecycle, roles, sql
from webapp.gateway.chat_request import PreviousTurn
from webapp.gateway.errors import GatewayError
from webapp.gateway.last_turns import LAST_TURNS, KnownTurn
from webapp.gateway.models import Interaction, Session
from webapp.runs.models import Run

REPLAY_WINDOW = timedelta(minutes=10)  # how long a one-turn completion answers an SDK retry

_KEYS, _AGENTS, _RUNS = APIKey._meta.db_table, Agent._meta.db_table, Run._meta.db_table
_SESSIONS, _INTERACTIONS = Session._meta.db_table, Interaction._meta.db_table
_RUN_COLUMNS = "r.id, r.name, r.status, r.weight_version, r.config, r.base_model, r.created_at"


def _session_key_statement(last_turn: bool, known: bool = False) -> str:
    """The session key's session, agent and run; with ``last_turn``, the session's last turn;
    with ``known``, only when the session is not the one of the first parameter at the turn
    count of the second (a turn this process holds: ``webapp.gateway.last_turns``)."""
    turn_columns = (
        ", t.request_hash, t.messages, t.tools, t.input_ids, t.outputs, t.response, t.id,"
        " t.prefix_turn"
    )
    turn_join = (
        f" LEFT JOIN {_INTERACTIONS} t ON t.session_id = s.id AND t.turn = s.interaction_count - 1"
    )
    if known:
        turn_join += " AND NOT (s.id = %s AND s.interaction_count = %s)"
    return (
        f"SELECT s.id, s.status, s.server_url, s.interaction_count, s.agent_id, a.name,"
        f" a.project_id, {_RUN_COLUMNS}, a.role{turn_columns if last_turn else ''} FROM {_SESSIONS} s"
        f" JOIN {_AGENTS} a ON a.id = s.agent_id LEFT JOIN {_RUNS} r ON r.id = a.run_id"
        f"{turn_join if last_turn else ''} WHERE s.key_hash = %s"
    )


# (last turn, a copy of it known) → statement
_SESSION_KEY = {
    (False, False): _session_key_statement(False),
    (True, False): _session_key_statement(True),
    (True, True): _session_key_statement(True, known=True),
}


@dataclass(frozen=True)
class RunInfo:
    id: uuid.UUID
    name: str
    status: str
    weight_version: int
    config: dict
    base_model: str
    created_at: datetime


@dataclass(frozen=True)
class Caller:
    """Who is calling which agent: the agent (with its run) and, for a session key, the session."""

    agent_id: uuid.UUID
    agent_name: str
    project_id: Any
    key_hash: str
    run: RunInfo | None
    session_id: uuid.UUID | None = None
    session_status: str | None = None
    session_server: str = ""
    session_turns: int = 0
    # request_hash, messages, tools, input_ids, outputs, response, id, prefix_turn
    last_turn: tuple | None = None
    known_turn: KnownTurn | None = None  # the last turn as this process recorded it
    agent_role: str = ""  # the role the agent is bound to in a multi-agent run


@dataclass(frozen=True)
class Turn:
    """What ``begin`` found or opened for one completion."""

    caller: Caller
    run: RunInfo
    session_id: uuid.UUID
    opened: bool  # a one-turn session admitted for this request (``record`` writes its row)
    sticky_server: str
    previous: PreviousTurn | None = None
    replay: dict | None = None  # an SDK retry: answer this recorded response, record nothing
    role: str = ""  # the multi-agent run's role this turn plays (``webapp.gateway.roles``)


def _run(row) -> RunInfo | None:
    if row[0] is None:
        return None
    return RunInfo(
        id=sql.as_uuid(row[0]),
        name=row[1],
        status=row[2],
        weight_version=int(row[3]),
        config=sql.loads(row[4]) or {},
        base_model=row[5],
        created_at=sql.as_datetime(row[6]),
    )


# --- Authentication ----------------------------------------------------------------------


def _agent_uuid(agent_id) -> uuid.UUID:
    try:
        return sql.as_uuid(agent_id)
    except ValueError:
        raise agent_not_found(agent_id) from None


def agent_not_found(agent_id) -> GatewayError:
    return GatewayError(404, f"Agent {agent_id} not found.", code="agent_not_found")


def missing_key() -> GatewayError:
    return GatewayError(
        401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
    )


def authenticate(cursor, *, token: str | None, agent_id, last_turn: bool = False) -> Caller:
    """A project key of the agent's project, or a session key of this agent; 401/404 otherwise.

    ``last_turn``: for a session key, also the session's last turn, as a chat turn needs it:
    this process's copy (``Caller.known_turn``) while the session is still at the turn count
    it was kept under, else its row, read in the same statement (``Caller.last_turn``).
    """
    if not token:
        raise missing_key()
    agent_uuid = _agent_uuid(agent_id)
    key_hash = hash_key(token)
    if token.startswith(SESSION_KEY_PREFIX):
        known = LAST_TURNS.get(key_hash) if last_turn else None
        params: list = [key_hash]
        if known is not None:
            params[:0] = [sql.pk(cursor, Session, known.session_id), known.count]
        cursor.execute(_SESSION_KEY[last_turn, known is not None], params)
        row = cursor.fetchone()
        if row is None:
            raise GatewayError(401, "Invalid or superseded session key.", code="invalid_api_key")
        if sql.as_uuid(row[4]) != agent_uuid:
            raise agent_not_found(agent_id)
        session_id, count = sql.as_uuid(row[0]), int(row[3])
        return Caller(
            agent_id=agent_uuid,
            agent_name=row[5],
            project_id=row[6],
            key_hash=key_hash,
            run=_run(row[7:]),
            session_id=session_id,
            session_status=row[1],
            session_server=row[2] or "",
            session_turns=count,
            last_turn=row[15:] if last_turn and row[15] is not None else None,
            known_turn=known if known is not None and known.holds(session_id, count) else None,
            agent_role=row[14] or "",
        )
    cursor.execute(
        f"SELECT k.id, k.project_id, k.revoked_at, k.expires_at, k.last_used_at, a.id, a.name,"
        f" {_RUN_COLUMNS}, a.role FROM {_KEYS} k"
        f" LEFT JOIN {_AGENTS} a ON a.project_id = k.project_id AND a.id = %s"
        f" LEFT JOIN {_RUNS} r ON r.id = a.run_id WHERE k.hashed = %s",
        [sql.pk(cursor, Agent, agent_uuid), key_hash],
    )
    row = cursor.fetchone()
    now = timezone.now()
    if row is None or row[2] is not None or (row[3] is not None and sql.as_datetime(row[3]) <= now):
        raise GatewayError(401, "Invalid, expired or revoked API key.", code="invalid_api_key")
    last_used = sql.as_datetime(row[4])
    if last_used is None or now - last_used > LAST_USED_RESOLUTION:
        cursor.execute(
            f"UPDATE {_KEYS} SET last_used_at = %s WHERE id = %s",
            [sql.value(cursor, APIKey, "last_used_at", now), row[0]],
        )
    if row[5] is None:
        raise agent_not_found(agent_id)
    return Caller(
        agent_id=agent_uuid,
        agent_name=row[6],
        project_id=row[1],
        key_hash=key_hash,
        run=_run(row[7:]),
        agent_role=row[14] or "",
    )


def identify(cursor, *, token: str | None, agent_id, last_turn: bool = False) -> Caller:
    """``authenticate``, then one request counted against the key's rate limit. Limiting
    after authentication counts only real keys; limiting before the run's state is checked
    means a client hammering a stopped run is slowed down too."""
    caller = authenticate(cursor, token=token, agent_id=agent_id, last_turn=last_turn)
    rate_limit(caller)
    return caller


def rate_limit(caller: Caller) -> None:
    """Count one request against the key's per-minute limit (off when the setting is 0)."""
    limit = settings.RATE_LIMIT_GATEWAY_PER_MIN
    if limit <= 0:
        return
    limited = ratelimit.hit(f"gw:{caller.key_hash[:32]}", limit=limit)
    if limited is not None:
        raise GatewayError(
            429,
            f"Rate limit of {limit} requests per minute exceeded for this key; retry after {limited.retry_after} s.",
            code="rate_limit_exceeded",
            retry_after=limited.retry_after,
        )


def serving(caller: Caller) -> RunInfo:
    """The caller's run if it can serve now; otherwise a 503 that says what to start."""
    run = caller.run
    if run is None:
        raise GatewayError(
            503,
            f"Agent '{caller.agent_name}' has no run. Bind it to a run and start the run.",
            code="no_run",
        )
    if run.status != Run.Status.RUNNING:
        raise not_running(run, run.status)
    return run


def not_running(run: RunInfo, status: str) -> GatewayError:
    return GatewayError(
        503,
        f"Run '{run.name}' is {status}, not running. Start it from the dashboard or POST /api/v1/runs/{run.id}/start/.",
        code="run_not_running",
    )


def session_gone(session_id, status: str) -> GatewayError | None:
    """The error for a request on a session that is no longer open (None when it is open)."""
    if status == Session.Status.EXPIRED:
        return GatewayError(
            410,
            f"Session {session_id} expired after {settings.SESSION_IDLE_TIMEOUT_S} s idle; start a new one with POST /rl/start_session.",
            code="session_expired",
        )
    if status != Session.Status.OPEN:
        return GatewayError(
            409,
            f"Session {session_id} has ended; start a new one with POST /rl/start_session.",
            code="session_ended",
        )
    return None


def budget_full(cursor, run: RunInfo) -> GatewayError:
    cursor.execute(
        f"SELECT status, weight_version, sessions_open, sessions_accepted FROM {_RUNS} WHERE id = %s",
        [admission.run_pk(cursor, run.id)],
    )
    status, version, running, accepted = cursor.fetchone()
    if status != Run.Status.RUNNING:
        return not_running(run, status)
    pool_limit = admission.pool_session_limit(cursor, run.config)
    if pool_limit and running >= pool_limit:
        return GatewayError(
            429,
            f"This run has {running} open sessions in inference pool "
            f"'{run.config['inference_pool']}', whose max_sessions_per_run is {pool_limit}; "
            "retry when one has ended.",
            code="pool_sessions_per_run",
            retry_after=settings.GATEWAY_RETRY_AFTER_S,
        )
    max_staleness = admission.budget(run.config).max_staleness
    ratelimit.tally(admission.refused_bucket(run.id))  # the run page says agents back off
    return GatewayError(
        429,
        f"The run's staleness budget is full ({accepted} accepted + {running} running episodes "
        f"at policy version {version}, max_staleness {max_staleness}). Retry after training catches up.",
        code="staleness_budget_full",
        retry_after=settings.GATEWAY_RETRY_AFTER_S,
    )


# --- The two trips of a completion -------------------------------------------------------


def begin(*, token: str | None, agent_id, fingerprint: str, is_retry: bool, model: str = ""):
    """The operation that starts a completion; returns a ``Turn``. ``model``: the request's,
    which names the role of a multi-agent run (``webapp.gateway.roles``)."""

    def operation(cursor) -> Turn:
        caller = identify(cursor, token=token, agent_id=agent_id, last_turn=True)
        run = serving(caller)
        role = roles.turn_role(
            roles=roles.run_roles(run.config), model=model, agent_role=caller.agent_role
        )
        if caller.session_id is not None:
            gone = session_gone(caller.session_id, caller.session_status)
            if gone is not None:
                raise gone
            known = caller.known_turn
            previous, last = (
                (known.previous, (known.request_hash, known.response))
                if known is not None
                else earlier_turns.read_turn(
                    cursor, caller.session_id, caller.session_turns - 1, caller.last_turn
                )
            )
            if last is not None and last[0] == fingerprint:
                # An SDK retry of the last turn: same answer, nothing recorded twice.
                return Turn(caller, run, caller.session_id, False, "", replay=last[1], role=role)
            return Turn(
                caller,
                run,
                caller.session_id,
                False,
                caller.session_server,
                previous=previous,
                role=role,
            )
        if is_retry:
            replay = _recent_replay(cursor, caller.agent_id, fingerprint)
            if replay is not None:
                return Turn(caller, run, new_uuid(), False, "", replay=replay, role=role)
        if not lifecycle.admit(cursor, run_id=run.id, config=run.config):
            raise budget_full(cursor, run)
        # The one-turn session's row is written with its interaction (``record``); until
        # then only its admission slot exists (``discard`` gives it back).
        return Turn(caller, run, new_uuid(), True, "", role=role)

    return operation


def _recent_replay(cursor, agent_id, fingerprint: str) -> dict | None:
    """A one-turn completion of this agent with the same request, recorded recently."""
    since = sql.value(cursor, Interaction, "created_at", timezone.now() - REPLAY_WINDOW)
    cursor.execute(
        f"SELECT i.response FROM {_INTERACTIONS} i JOIN {_SESSIONS} s ON s.id = i.session_id"
        " WHERE s.agent_id = %s AND s.one_turn = %s AND i.request_hash = %s AND i.created_at >= %s"
        " ORDER BY i.created_at DESC LIMIT 1",
        [sql.pk(cursor, Agent, agent_id), True, fingerprint, since],
    )
    row = cursor.fetchone()
    return None if row is None else sql.loads(row[0])


def record(
    *,
    turn: Turn,
    interaction_id: str,
    request_hash: str,
    messages: list,
    tools,
    sampling: dict,
    input_ids: list[int],
    prefix_reused: bool,
    outputs: list[dict],
    response: dict,
    server_url: str,
    latency_ms: float,
    previous_chosen: int | None,
    prefix: deltas.Prefix | None = None,
):
    """The operation that stores one turn (with ``prefix``, only what it added to that turn:
    ``webapp.gateway.deltas``); returns a ``Recorded``: the response to send (the
    original's, for a retry that overlapped it) and, for a session's turn, the turn as the next
    one continues it (``remember`` it once the operation is committed)."""

    def operation(cursor) -> Recorded:
        now = timezone.now()
        if turn.opened:
            number = 0
            lifecycle.insert_open(cursor, _one_turn_session(turn, server_url, now))
        else:
            number = _next_turn(cursor, turn.session_id, request_hash, previous_chosen)
            if isinstance(number, dict):
                return Recorded(number)  # a retry that overlapped its original: the first answer
        sql.insert(
            cursor,
            Interaction,
            {
                "id": interaction_id,
                "session": turn.session_id,
                "turn": number,
                "request_hash": request_hash,
                **deltas.stored(prefix if not turn.opened else None, messages, input_ids),
                "tools": tools,
                "sampling": sampling,
                **Interaction.sampling_columns(sampling),
                "prefix_reused": prefix_reused,
                "outputs": outputs,
                "chosen": 0,
                "response": response,
                "server_url": server_url,
                "latency_ms": latency_ms,
                "created_at": now,
                "role": turn.role,
            },
        )
        if turn.opened and outputs and all(out.get("aborted") for out in outputs):
            # A one-turn session whose only turn was aborted has nothing to train: it ends
            # now, dropped, and gives its admission slot back instead of holding it until
            # it expires. The turn stays for inspection.
            lifecycle.end(cursor, turn.session_id)
            lifecycle.drop_unrewarded(cursor, turn.session_id, reason=lifecycle.DROP_ABORTED)
        if not turn.opened:
            cursor.execute(
                f"UPDATE {_SESSIONS} SET interaction_count = %s, last_activity_at = %s,"
                " server_url = %s WHERE id = %s",
                [
                    number + 1,
                    sql.value(cursor, Session, "last_activity_at", now),
                    server_url,
                    sql.pk(cursor, Session, turn.session_id),
                ],
            )
            # What the session's next turn continues, as the row holds it. The answers' ids are
            # copied: a stream's choice still owns its list.
            kept = [{"output_ids": list(out["output_ids"])} for out in outputs]
            previous = earlier_turns.previous_turn(
                messages, tools, input_ids, kept, response, interaction_id, number
            )
            known = KnownTurn(turn.session_id, number + 1, previous, request_hash, response)
            return Recorded(response, known)
        return Recorded(response)

    return operation


@dataclass(frozen=True)
class Recorded:
    """What ``record`` stored: the response to send and, for a session's turn, the turn itself."""

    response: dict
    turn: KnownTurn | None = None


def remember(turn: Turn, recorded: Recorded) -> None:
    """Keep a committed session turn for the session's next turn (``webapp.gateway.last_turns``)."""
    if recorded.turn is not None:
        LAST_TURNS.put(turn.caller.key_hash, recorded.turn)


def _one_turn_session(turn: Turn, server_url: str, now: datetime) -> dict[str, Any]:
    return {
        "id": turn.session_id,
        "project": turn.caller.project_id,
        "agent": turn.caller.agent_id,
        "run": turn.run.id,
        "key_hash": None,
        "one_turn": True,
        "task_id": "",
        "metadata": {},
        "admitted_version": turn.run.weight_version,
        "interaction_count": 1,
        "server_url": server_url,
        "created_at": now,
        "last_activity_at": now,
    }


def _next_turn(cursor, session_id, request_hash: str, previous_chosen: int | None) -> int | dict:
    """The number of the session's next turn (locking the session), or the response of its last
    turn when that was the same request."""
    session_pk = sql.pk(cursor, Session, session_id)
    cursor.execute(
        f"SELECT s.status, s.interaction_count, t.request_hash, t.chosen FROM {_SESSIONS} s"
        f" LEFT JOIN {_INTERACTIONS} t ON t.session_id = s.id AND t.turn = s.interaction_count - 1"
        f" WHERE s.id = %s{sql.for_update(cursor, of='s')}",
        [session_pk],
    )
    row = cursor.fetchone()
    if row is None or row[0] != Session.Status.OPEN:
        raise GatewayError(
            409,
            f"Session {session_id} ended while the request was in flight.",
            code="session_ended",
        )
    number, last_hash, last_chosen = int(row[1]), row[2], row[3]
    if last_hash is None:  # the first turn
        return number
    last_turn = [session_pk, number - 1]
    if last_hash == request_hash:
        cursor.execute(
            f"SELECT response FROM {_INTERACTIONS} WHERE session_id = %s AND turn = %s",
            last_turn,
        )
        return sql.loads(cursor.fetchone()[0])
    if previous_chosen is not None and last_chosen != previous_chosen:
        cursor.execute(
            f"UPDATE {_INTERACTIONS} SET chosen = %s WHERE session_id = %s AND turn = %s",
            [previous_chosen, *last_turn],
        )
    return number


def discard(*, turn: Turn):
    """The operation that gives back the admission slot of a one-turn completion that failed
    before it was recorded. A request cancelled while its ``record`` was already queued may
    still have been recorded (operations run in order): then its slot stays taken."""

    def operation(cursor) -> None:
        if turn.opened:
            lifecycle.give_back(cursor, run_id=turn.run.id, session_id=turn.session_id)

    return operation
