"""The data proxy's writes: auth, sessions, staleness admission, recording turns, rewards.

All functions are synchronous (the async views call them through ``sync_to_async``)
and every write that acknowledges data commits before it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from webapp.accounts.keys import SESSION_KEY_PREFIX, generate_key, hash_key
from webapp.agents.models import Agent
from webapp.gateway import admission, turns
from webapp.gateway.errors import GatewayError
from webapp.gateway.models import InferenceServer, Interaction, Session
from webapp.runs.models import Run

S = Session.Status
T = Session.Trajectory


@dataclass
class GatewayAuth:
    agent: Agent
    session: Session | None  # set when the bearer is a session key
    caller: turns.Caller


def gateway_authenticate(*, token: str | None, agent_id: str) -> GatewayAuth:
    """A project key of the agent's project, or a session key of this agent. Others: 401/404.

    The rules are ``turns.authenticate`` (the chat hot path's); this loads the models for
    the ORM services.
    """
    if not token:
        raise turns.missing_key()  # before touching the database
    with connection.cursor() as cursor:
        caller = turns.authenticate(cursor, token=token, agent_id=agent_id)
    agent = Agent.objects.select_related("run", "project").filter(pk=caller.agent_id).first()
    session = None
    if caller.session_id is not None:
        session = Session.objects.filter(pk=caller.session_id).first()
    if agent is None or (caller.session_id is not None and session is None):
        raise turns.agent_not_found(agent_id)
    return GatewayAuth(agent=agent, session=session, caller=caller)


def serving_run(auth: GatewayAuth) -> Run:
    """The agent's run, if it can serve now (``turns.serving``); otherwise a 503 that says what to start."""
    turns.serving(auth.caller)
    return auth.agent.run


# --- Staleness admission -------------------------------------------------------------------


def _admit(run: Run) -> None:
    """Take one slot of the run's staleness budget, or raise 429 (``admission.admit``)."""
    with connection.cursor() as cursor:
        if not admission.admit(cursor, run_id=run.pk, config=run.config):
            raise turns.budget_full(cursor, run)


def _counted(run_id, *, opened: int = 0, accepted: int = 0) -> None:
    with connection.cursor() as cursor:
        admission.count(cursor, run_id, opened=opened, accepted=accepted)


def session_open(
    *,
    agent: Agent,
    run: Run,
    task_id: str = "",
    metadata: dict | None = None,
    replaces: Session | None = None,
) -> tuple[Session, str | None]:
    """Admit and open a session. Returns it with its plaintext key (None when ``replaces``
    hands its key on). One-turn sessions are not opened here: ``turns.record`` writes them.

    ``replaces``: a live session whose key is moved onto the new session (the agent
    keeps its key across episodes); the old session ends first.
    """
    with transaction.atomic():
        if replaces is not None:
            _end_locked(Session.objects.select_for_update().get(pk=replaces.pk))
        _admit(run)
        plaintext = None
        key_hash = None
        if replaces is not None:
            key_hash = replaces.key_hash
            Session.objects.filter(pk=replaces.pk).update(key_hash=None)
        else:
            plaintext = generate_key(SESSION_KEY_PREFIX)
            key_hash = hash_key(plaintext)
        session = Session.objects.create(
            project_id=agent.project_id,
            agent=agent,
            run=run,
            key_hash=key_hash,
            task_id=task_id,
            metadata=metadata or {},
            admitted_version=run.weight_version,
        )
    return session, plaintext


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
    _counted(session.run_id, opened=-1, accepted=int(train))
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
                _counted(locked.run_id, accepted=1)
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
