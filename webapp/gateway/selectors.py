"""Reads for the gateway: serving servers, sessions, turns and trajectories."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from django.db.models import FloatField, OuterRef, Prefetch, Q, QuerySet, Subquery, Sum
from django.http import Http404
from django.utils import timezone

from rl_core.types import Trajectory
from webapp.accounts.models import Project
from webapp.accounts.selectors import parse_uuid
from webapp.gateway.models import InferenceServer, Interaction, Session
from webapp.runs.models import Run

logger = logging.getLogger(__name__)


def server_candidates(*, run_id) -> list[tuple[str, bool]]:
    """Serving server URLs of a run with their ``healthy`` flag, in registration order (a
    server whose back-off has passed is listed with ``False``); ``inference.order_candidates`` puts
    them best first for a request."""
    now = timezone.now()
    servers = list(
        InferenceServer.objects.filter(run_id=run_id)
        .filter(Q(healthy=True) | Q(unhealthy_until__lt=now))
        .order_by("registered_at")
        .values_list("url", "healthy")
    )
    return servers


def session_list(
    *, project: Project, agent_id=None, run_id=None, status: str | None = None
) -> QuerySet[Session]:
    sessions = Session.objects.filter(project=project).select_related("agent", "run")
    if agent_id:
        sessions = sessions.filter(agent_id=parse_uuid(agent_id))
    if run_id:
        sessions = sessions.filter(run_id=parse_uuid(run_id))
    if status:
        sessions = sessions.filter(Q(status=status) | Q(trajectory=status))
    return sessions.annotate(reward_total=_reward_total()).order_by("-created_at")


def session_count(
    *, project: Project, agent_id=None, run_id=None, status: str | None = None
) -> int:
    """How many sessions ``session_list`` lists with these filters."""
    return session_list(project=project, agent_id=agent_id, run_id=run_id, status=status).count()


def _reward_total() -> Subquery:
    # A subquery rather than a join: no GROUP BY over the sessions' columns.
    totals = (
        Interaction.objects.filter(session=OuterRef("pk"), reward__isnull=False)
        .order_by()
        .values("session")
        .annotate(total=Sum("reward"))
        .values("total")
    )
    return Subquery(totals, output_field=FloatField())


def session_get(*, project: Project, session_id) -> Session:
    session = (
        Session.objects.filter(project=project, pk=parse_uuid(session_id))
        .select_related("agent", "run")
        .annotate(reward_total=_reward_total())
        .first()
    )
    if session is None:
        raise Http404("Session not found.")
    return session


def session_interactions(*, session: Session) -> list[Interaction]:
    return list(session.interactions.order_by("turn"))


def interaction_list(*, project: Project, agent_id=None, run_id=None) -> QuerySet[Interaction]:
    """A project's recorded turns, newest first; prompt ids and raw responses are left unloaded."""
    interactions = (
        Interaction.objects.filter(session__project=project)
        .select_related("session")
        .defer("input_ids", "response")
    )
    if agent_id:
        interactions = interactions.filter(session__agent_id=parse_uuid(agent_id))
    if run_id:
        interactions = interactions.filter(session__run_id=parse_uuid(run_id))
    return interactions.order_by("-created_at", "-turn")


def session_trajectories(
    session: Session, interactions: list[Interaction] | None = None
) -> list[Trajectory]:
    """The session as trainable sequences.

    Turns whose prompt extended the previous turn's exact tokens form one sequence
    (the literal stream the model saw); a turn rendered afresh starts a new one.
    Only the choice the conversation continued with (or choice 0) is trained; an aborted turn
    (its client went away mid-stream) is not: a later turn may still carry its tokens as
    context, with no loss on them. Each output
    token carries its turn's logprob temperature (``rl_core.sampling``); ``temperatures``
    is None when all are 1.0.
    """
    turns = [
        turn
        for turn in (
            interactions
            if interactions is not None
            else list(session.interactions.order_by("turn"))
        )
        if not turn.aborted
    ]
    chains: list[list[Interaction]] = []
    for turn in turns:
        if chains and turn.prefix_reused:
            chains[-1].append(turn)
        else:
            chains.append([turn])
    trajectories = []
    for index, chain in enumerate(chains):
        last = chain[-1]
        out = last.outputs[last.chosen]
        ids = list(last.input_ids) + list(out["output_ids"])
        mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
        temperatures = [1.0] * len(ids)  # each output token's: the one its logprob was taken at
        turn_ends, rewards = [], []
        for turn in chain:
            chosen = turn.outputs[turn.chosen]
            start = len(turn.input_ids)
            n_out = len(chosen["output_ids"])
            temperatures[start : start + n_out] = [turn.logprob_temperature] * n_out
            for offset, (lp, version) in enumerate(
                zip(chosen["logprobs"], chosen["versions"], strict=True)
            ):
                mask[start + offset], logprobs[start + offset], versions[start + offset] = (
                    1,
                    lp,
                    version,
                )
            turn_ends.append(start + len(chosen["output_ids"]))
            rewards.append(turn.reward if turn.reward is not None else 0.0)
        if not any(mask):
            continue
        turn_ends[-1] = len(ids)
        trajectories.append(
            Trajectory(
                input_ids=ids,
                loss_mask=mask,
                logprobs=logprobs,
                versions=versions,
                rewards=rewards,
                group_id=str(session.metadata.get("group_id", ""))
                if isinstance(session.metadata, dict)
                else "",
                session_id=f"{session.id}" if len(chains) == 1 else f"{session.id}#{index}",
                turn_ends=turn_ends,
                temperatures=temperatures if any(t != 1.0 for t in temperatures) else None,
                metadata={"task_id": session.task_id, "interactions": [t.id for t in chain]},
            )
        )
    return trajectories


def trajectories_export(
    *, run: Run, status: str | None = None, chunk_size: int = 100
) -> Iterator[dict]:
    """Every trajectory of ``run``, oldest session first, as JSON-safe dicts, read in chunks.

    Each is ``Trajectory.to_dict()`` (its ``session_id`` is the session's id, suffixed
    ``#k`` when the session split into several sequences) plus ``agent_id``, ``task_id``,
    ``status`` (the session's) and ``trajectory`` (its training state). ``status``
    filters on either, as in ``session_list``.
    """
    sessions = Session.objects.filter(project_id=run.project_id, run=run).prefetch_related(
        Prefetch("interactions", queryset=Interaction.objects.order_by("turn"))
    )
    if status:
        sessions = sessions.filter(Q(status=status) | Q(trajectory=status))
    for session in sessions.order_by("created_at", "id").iterator(chunk_size=chunk_size):
        try:
            trajectories = session_trajectories(session, list(session.interactions.all()))
        except ValueError as exc:  # a malformed recording must not cut the export short
            logger.warning("Session %s left out of the export: %s", session.id, exc)
            continue
        for trajectory in trajectories:
            yield trajectory.to_dict() | {
                "agent_id": str(session.agent_id) if session.agent_id else None,
                "task_id": session.task_id,
                "status": session.status,
                "trajectory": session.trajectory,
            }
