"""The data proxy's writes: auth, sessions, staleness admission, recording turns, rewards.

All functions are synchronous (the async views call them through ``sync_to_async``)
and every write that acknowledges data commits before it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from rl_core.staleness import free_capacity
from webapp.accounts.keys import SESSION_KEY_PREFIX, generate_key, hash_key
from webapp.accounts.selectors import parse_uuid
from webapp.accounts.services import api_key_authenticate
from webapp.agents.models import Agent
from webapp.gateway.errors import GatewayError
from webapp.gateway.models import InferenceServer, Interaction, Session
from webapp.runs.models import Run

S = Session.Status
T = Session.Trajectory
ACCEPTED = (T.READY, T.CLAIMED, T.TRAINED, T.DROPPED)


@dataclass
class GatewayAuth:
    agent: Agent
    session: Session | None  # set when the bearer is a session key


def gateway_authenticate(*, token: str | None, agent_id: str) -> GatewayAuth:
    """A project key of the agent's project, or a session key of this agent. Others: 401/404."""
    if not token:
        raise GatewayError(
            401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
        )
    if token.startswith(SESSION_KEY_PREFIX):
        session = (
            Session.objects.select_related("agent__run", "agent__project")
            .filter(key_hash=hash_key(token))
            .first()
        )
        if session is None:
            raise GatewayError(401, "Invalid or superseded session key.", code="invalid_api_key")
        if str(session.agent_id) != str(_agent_uuid(agent_id)):
            raise GatewayError(404, f"Agent {agent_id} not found.", code="agent_not_found")
        return GatewayAuth(agent=session.agent, session=session)
    key = api_key_authenticate(plaintext=token)
    if key is None:
        raise GatewayError(401, "Invalid, expired or revoked API key.", code="invalid_api_key")
    agent = (
        Agent.objects.select_related("run", "project")
        .filter(pk=_agent_uuid(agent_id), project=key.project)
        .first()
    )
    if agent is None:
        raise GatewayError(404, f"Agent {agent_id} not found.", code="agent_not_found")
    return GatewayAuth(agent=agent, session=None)


def _agent_uuid(agent_id: str):
    try:
        return parse_uuid(agent_id)
    except Exception:
        raise GatewayError(404, f"Agent {agent_id} not found.", code="agent_not_found") from None


def serving_run(agent: Agent) -> Run:
    """The agent's run, if it can serve now; otherwise a 503 that says what to start."""
    run = agent.run
    if run is None:
        raise GatewayError(
            503,
            f"Agent '{agent.name}' has no run. Bind it to a run and start the run.",
            code="no_run",
        )
    run.refresh_from_db(fields=["status", "weight_version", "config"])
    if run.status != Run.Status.RUNNING:
        raise GatewayError(
            503,
            f"Run '{run.name}' is {run.status}, not running. Start it from the dashboard or POST /api/v1/runs/{run.id}/start/.",
            code="run_not_running",
        )
    return run


# --- Staleness admission -------------------------------------------------------------------


def _admit_locked(run: Run) -> None:
    """Raise 429 unless one more episode fits the run's staleness budget. Caller holds the run's row lock."""
    config = run.config
    running = Session.objects.filter(run=run, status=S.OPEN).count()
    accepted = Session.objects.filter(run=run, trajectory__in=ACCEPTED).count()
    free = free_capacity(
        max_staleness=config.get("max_staleness", 4),
        version=run.weight_version,
        batch_size=config.get("batch_size", 8),
        accepted=accepted,
        running=running,
        max_concurrent_rollouts=config.get("max_concurrent_rollouts") or 0,
    )
    if free <= 0:
        raise GatewayError(
            429,
            f"The run's staleness budget is full ({accepted} accepted + {running} running episodes at policy version "
            f"{run.weight_version}, max_staleness {config.get('max_staleness')}). Retry after training catches up.",
            code="staleness_budget_full",
            retry_after=settings.GATEWAY_RETRY_AFTER_S,
        )


def session_open(
    *,
    agent: Agent,
    run: Run,
    one_turn: bool,
    task_id: str = "",
    metadata: dict | None = None,
    replaces: Session | None = None,
) -> tuple[Session, str | None]:
    """Admit and open a session. Returns it with its plaintext key (None for one-turn sessions).

    ``replaces``: a live session whose key is moved onto the new session (the agent
    keeps its key across episodes); the old session ends first.
    """
    with transaction.atomic():
        locked_run = Run.objects.select_for_update().get(pk=run.pk)
        if replaces is not None:
            _end_locked(Session.objects.select_for_update().get(pk=replaces.pk))
        _admit_locked(locked_run)
        plaintext = None
        key_hash = None
        if replaces is not None:
            key_hash = replaces.key_hash
            Session.objects.filter(pk=replaces.pk).update(key_hash=None)
        elif not one_turn:
            plaintext = generate_key(SESSION_KEY_PREFIX)
            key_hash = hash_key(plaintext)
        session = Session.objects.create(
            project_id=agent.project_id,
            agent=agent,
            run=locked_run,
            key_hash=key_hash,
            one_turn=one_turn,
            task_id=task_id,
            metadata=metadata or {},
            admitted_version=locked_run.weight_version,
        )
    return session, plaintext


def session_discard(*, session: Session) -> None:
    """Remove a one-turn session whose request failed before anything was recorded."""
    if session.one_turn and not session.interactions.exists():
        session.delete()


def session_require_open(session: Session) -> Session:
    session.refresh_from_db()
    if session.status == S.EXPIRED:
        raise GatewayError(
            410,
            f"Session {session.id} expired after {settings.SESSION_IDLE_TIMEOUT_S} s idle; start a new one with POST /rl/start_session.",
            code="session_expired",
        )
    if session.status != S.OPEN:
        raise GatewayError(
            409,
            f"Session {session.id} has ended; start a new one with POST /rl/start_session.",
            code="session_ended",
        )
    return session


def _end_locked(session: Session, *, status: str = S.ENDED) -> Session:
    if session.status != S.OPEN:
        return session
    rewarded = session.interactions.filter(reward__isnull=False).exists()
    train = rewarded and (
        status == S.ENDED
        or session.run is None
        or session.run.config.get("train_incomplete_sessions", False)
    )
    session.status = status
    session.trajectory = T.READY if train else T.UNREWARDED
    session.ended_at = timezone.now()
    session.save(update_fields=["status", "trajectory", "ended_at"])
    return session


def session_end(*, session: Session) -> Session:
    with transaction.atomic():
        locked = (
            Session.objects.select_for_update(of=("self",)).select_related("run").get(pk=session.pk)
        )
        if locked.status == S.EXPIRED:
            raise GatewayError(410, f"Session {locked.id} already expired.", code="session_expired")
        if locked.status == S.ENDED:
            raise GatewayError(409, f"Session {locked.id} already ended.", code="session_ended")
        return _end_locked(locked)


def sessions_expire_idle(*, now=None) -> int:
    """Close sessions idle longer than SESSION_IDLE_TIMEOUT_S as expired (kept; trained only if configured)."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.SESSION_IDLE_TIMEOUT_S)
    count = 0
    for session_id in Session.objects.filter(
        status=S.OPEN, last_activity_at__lt=cutoff
    ).values_list("pk", flat=True):
        with transaction.atomic():
            locked = (
                Session.objects.select_for_update(of=("self",))
                .select_related("run")
                .get(pk=session_id)
            )
            if locked.status == S.OPEN and locked.last_activity_at < cutoff:
                _end_locked(locked, status=S.EXPIRED)
                count += 1
    return count


# --- Recording -----------------------------------------------------------------------------


def interaction_record(
    *,
    session: Session,
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
) -> Interaction:
    """Store one turn durably (committed before the caller answers the agent)."""
    with transaction.atomic():
        locked = Session.objects.select_for_update().get(pk=session.pk)
        if locked.status != S.OPEN:
            raise GatewayError(
                409,
                f"Session {locked.id} ended while the request was in flight.",
                code="session_ended",
            )
        turn = locked.interaction_count
        if turn > 0:
            last = Interaction.objects.filter(session=locked, turn=turn - 1).first()
            if last is not None and last.request_hash == request_hash:
                return last  # a retry that overlapped its original: keep the first answer only
        if previous_chosen is not None and turn > 0:
            Interaction.objects.filter(session=locked, turn=turn - 1).update(chosen=previous_chosen)
        interaction = Interaction.objects.create(
            id=interaction_id,
            session=locked,
            turn=turn,
            request_hash=request_hash,
            messages=messages,
            tools=tools,
            sampling=sampling,
            input_ids=input_ids,
            prefix_reused=prefix_reused,
            outputs=outputs,
            response=response,
            server_url=server_url,
            latency_ms=latency_ms,
        )
        locked.interaction_count = turn + 1
        locked.last_activity_at = timezone.now()
        locked.server_url = server_url
        locked.save(update_fields=["interaction_count", "last_activity_at", "server_url"])
    return interaction


def reward_set(
    *, session: Session | None, agent: Agent, reward: float, interaction_id: str | None
) -> Interaction:
    """Set a turn's reward (the last turn when no id). Setting the same value again changes nothing.

    With a project key (``session`` None) an ``interaction_id`` is required: it names a
    one-turn completion of this agent, whose session then ends and goes to training.
    """
    with transaction.atomic():
        if session is None:
            if not interaction_id:
                raise GatewayError(
                    400,
                    "With a project key, set_reward needs 'interaction_id' (the completion's id).",
                    param="interaction_id",
                    code="missing_required_parameter",
                )
            interaction = (
                Interaction.objects.select_related("session")
                .filter(pk=interaction_id, session__agent=agent)
                .first()
            )
            if interaction is None:
                raise GatewayError(
                    404,
                    f"Interaction {interaction_id} not found.",
                    param="interaction_id",
                    code="interaction_not_found",
                )
            session = interaction.session
        locked = (
            Session.objects.select_for_update(of=("self",)).select_related("run").get(pk=session.pk)
        )
        if locked.status == S.EXPIRED:
            raise GatewayError(
                410,
                f"Session {locked.id} expired; its rewards can no longer change.",
                code="session_expired",
            )
        if interaction_id:
            interaction = Interaction.objects.filter(pk=interaction_id, session=locked).first()
            if interaction is None:
                raise GatewayError(
                    404,
                    f"Interaction {interaction_id} not found in this session.",
                    param="interaction_id",
                    code="interaction_not_found",
                )
        else:
            interaction = Interaction.objects.filter(session=locked).order_by("-turn").first()
            if interaction is None:
                raise GatewayError(
                    409, "The session has no completion to reward yet.", code="no_interaction"
                )
        if interaction.reward == reward:
            return interaction
        if locked.status == S.ENDED and not locked.one_turn:
            raise GatewayError(
                409, f"Session {locked.id} has ended; its rewards are final.", code="session_ended"
            )
        if locked.one_turn and locked.trajectory not in (T.PENDING, T.READY, T.UNREWARDED):
            raise GatewayError(
                409,
                "This completion has already gone to training; its reward is final.",
                code="session_ended",
            )
        interaction.reward = reward
        interaction.rewarded_at = timezone.now()
        interaction.save(update_fields=["reward", "rewarded_at"])
        locked.last_activity_at = timezone.now()
        locked.save(update_fields=["last_activity_at"])
        if locked.one_turn:
            if locked.status == S.OPEN:
                _end_locked(locked)
            elif locked.trajectory == T.UNREWARDED:
                Session.objects.filter(pk=locked.pk).update(trajectory=T.READY)
    return interaction


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
