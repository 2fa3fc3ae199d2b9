"""Reads for the gateway: serving servers, sessions, turns and trajectories."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from django.db.models import FloatField, OuterRef, Prefetch, Q, QuerySet, Subquery, Sum
from django.http import Http404
from django.utils import timezone

from rl_core.staleness import free_capacity
from rl_core.types import Trajectory
from webapp import ratelimit
from webapp.accounts.models import Project
from webapp.accounts.selectors import parse_uuid
from webapp.gateway import admission, branches, deltas
from webapp.gateway.models import InferenceServer, Interaction, Session
from webapp.runs.models import Run

logger = logging.getLogger(__name__)


def server_candidates(*, run_id) -> list[tuple[str, bool, str]]:
    """Serving server URLs of a run with their ``healthy`` flag and backend, in registration
    order (a server whose back-off has passed is listed with ``False``);
    ``inference.order_candidates`` puts them best first for a request."""
    now = timezone.now()
    servers = list(
        InferenceServer.objects.filter(run_id=run_id)
        .filter(Q(healthy=True) | Q(unhealthy_until__lt=now))
        .order_by("registered_at")
        .values_list("url", "healthy", "backend")
    )
    return servers


def session_list(
    *,
    project: Project,
    agent_id=None,
    run_id=None,
    status: str | None = None,
    role: str | None = None,
) -> QuerySet[Session]:
    """The project's sessions, newest first; ``role``: those with a turn of that role."""
    sessions = Session.objects.filter(project=project).select_related("agent", "run")
    if role:
        sessions = sessions.filter(
            pk__in=Interaction.objects.filter(session__project=project, role=role).values(
                "session_id"
            )
        )
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
    """The session's turns in order, each with its whole conversation (``deltas.expand``)."""
    turns = list(session.interactions.order_by("turn"))
    deltas.expand(turns)
    return turns


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

    The turns form a conversation tree (``webapp.gateway.branches``): retry orphans are left
    out, and each branch (a straight conversation: the main agent, or one sub-agent of several
    sharing the session key) is trained apart. Within a branch, a turn whose prompt begins
    with the previous turn's exact tokens (its prompt and the answer continued with) extends
    that sequence (the literal stream the model saw); a turn rendered afresh starts a new one.
    Only the choice the conversation continued with (or the recorded ``chosen``) is trained;
    an aborted turn (its client went away mid-stream) is not: a later turn may still carry its
    tokens as context, with no loss on them.
    A sequence whose last turn has no reward takes the session's (its last turn's). Each
    output token carries its turn's logprob temperature (``rl_core.sampling``);
    ``temperatures`` is None when all are 1.0.

    In a multi-agent run (turns recorded with a ``role``), each sequence holds one role's
    turns (``_role_sequences``) and its trajectory carries that ``role``.
    """
    if interactions is None:
        interactions = list(session.interactions.order_by("turn"))
    deltas.expand(interactions)
    turns = [turn for turn in interactions if not turn.aborted]
    kept, _ = branches.drop_retry_orphans(branches.conversation_tree(turns))
    sequences: list[list[branches.Node]] = []
    by_role = any(node.turn.role for node in kept)
    for branch in branches.branches(kept):
        if by_role:
            sequences.extend(_role_sequences(branch))
            continue
        for position, node in enumerate(branch):
            if position and _extends(node):
                sequences[-1].append(node)
            else:
                sequences.append([node])
    outcome = kept[-1].turn.reward if kept else None
    trajectories = []
    for index, sequence in enumerate(sequences):
        trajectory = _sequence_trajectory(session, sequence, outcome, by_role=by_role)
        if trajectory is not None:
            trajectories.append((index, trajectory))
    for index, trajectory in trajectories:
        trajectory.session_id = f"{session.id}" if len(sequences) == 1 else f"{session.id}#{index}"
        if session.hint:  # a self-distilling run's teacher context (rl_core.hints)
            trajectory.metadata["hint"] = session.hint
    return [trajectory for _, trajectory in trajectories]


def _extends(node: branches.Node) -> bool:
    """Whether ``node``'s prompt begins with its parent's exact prompt and continued answer."""
    parent = node.parent
    assert parent is not None
    seen = list(parent.turn.input_ids) + list(
        parent.turn.outputs[node.continued_choice]["output_ids"]
    )
    return list(node.turn.input_ids[: len(seen)]) == seen


def _role_sequences(branch: list[branches.Node]) -> list[list[branches.Node]]:
    """A multi-agent branch's turns as one role's sequences each: a turn extends the latest
    sequence of its own role when its prompt begins with that sequence's last prompt and
    continued answer (the other roles' turns in between are then context, not trained), and
    starts a new one otherwise."""
    sequences: list[list[branches.Node]] = []
    latest: dict[str, int] = {}  # role → index of its latest sequence
    for node in branch:
        index = latest.get(node.turn.role)
        if index is not None and _continues(node, sequences[index][-1]):
            sequences[index].append(node)
            continue
        latest[node.turn.role] = len(sequences)
        sequences.append([node])
    return sequences


def _continues(node: branches.Node, earlier: branches.Node) -> bool:
    """Whether ``node``'s prompt begins with ``earlier``'s exact prompt and continued answer."""
    seen = list(earlier.turn.input_ids) + list(earlier.turn.outputs[earlier.choice]["output_ids"])
    return list(node.turn.input_ids[: len(seen)]) == seen


def _sequence_trajectory(
    session: Session, sequence: list[branches.Node], outcome: float | None, by_role: bool = False
) -> Trajectory | None:
    # The choice each turn's successor continued with; the last turn's own. In a role's
    # sequence the successor may be another role's turn: the branch's continuation is the one.
    choices = (
        [node.choice for node in sequence]
        if by_role
        else [nxt.continued_choice for nxt in sequence[1:]] + [sequence[-1].choice]
    )
    last, last_choice = sequence[-1].turn, choices[-1]
    out = last.outputs[last_choice]
    ids = list(last.input_ids) + list(out["output_ids"])
    mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
    temperatures = [1.0] * len(ids)  # each output token's: the one its logprob was taken at
    turn_ends, rewards = [], []
    for node, choice in zip(sequence, choices, strict=True):
        turn = node.turn
        chosen = turn.outputs[choice]
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
        turn_ends.append(start + n_out)
        rewards.append(turn.reward if turn.reward is not None else 0.0)
    if not any(mask):
        return None
    if last.reward is None and outcome is not None:
        rewards[-1] = outcome  # a sub-agent's branch shares the episode's outcome
    turn_ends[-1] = len(ids)
    trajectory = Trajectory(
        input_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        rewards=rewards,
        group_id=str(session.metadata.get("group_id", ""))
        if isinstance(session.metadata, dict)
        else "",
        turn_ends=turn_ends,
        temperatures=temperatures if any(t != 1.0 for t in temperatures) else None,
        metadata={"task_id": session.task_id, "interactions": [n.turn.id for n in sequence]},
    )
    if by_role:
        trajectory.role = last.role
    return trajectory


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


def admission_state(run: Run) -> dict | None:
    """What the run page says about staleness admission: free session slots, and the 429s
    of the current minute (``webapp.ratelimit`` counts them); None for a run that is not an
    online run serving agents."""
    if run.mode != Run.Mode.ONLINE or run.status != Run.Status.RUNNING:
        return None
    budget = admission.budget(run.config or {})
    return {
        "free": free_capacity(
            **budget._asdict(),
            version=run.weight_version,
            accepted=run.sessions_accepted,
            running=run.sessions_open,
        ),
        "open": run.sessions_open,
        "max_staleness": budget.max_staleness,
        "batch_size": budget.batch_size,
        "refused": ratelimit.peek(admission.refused_bucket(run.id)),
    }
