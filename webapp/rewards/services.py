"""Rewards given after a session ends: by an LLM judge (``judge_due``) or by people
(``feedback_record``), and the timeout of a run that waits for people (``human_timeouts``).

Every session state change goes through ``webapp.gateway.lifecycle`` (unrewarded → ready when
a reward comes, unrewarded → dropped when a human reward never does). The judge's HTTP calls run
in a bounded thread pool inside the worker's ``rewards.tick`` task; this module's database
work stays on the task's own thread.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from rl_core.chat import load_chat_tokenizer
from rl_core.reward_specs import reward_setting
from webapp.gateway import deltas, lifecycle
from webapp.gateway.models import InferenceServer, Interaction, Session
from webapp.rewards import judge
from webapp.rewards.models import Feedback, JudgeCall, JudgeVerdict, RewardRequest

logger = logging.getLogger(__name__)

R = RewardRequest.State
S, T = Session.Status, Session.Trajectory
BACKOFF_FIRST_S, BACKOFF_MAX_S = 10.0, 600.0


class FeedbackInvalid(ValueError):
    """Feedback that says nothing, or names a turn of another session."""


def backoff_s(attempts: int) -> float:
    """Seconds before the next try after ``attempts`` failed calls: 10 s doubling, 10 min at most."""
    return min(BACKOFF_FIRST_S * 2 ** max(attempts - 1, 0), BACKOFF_MAX_S)


def _reward_spec(session_or_run) -> dict:
    run = getattr(session_or_run, "run", session_or_run)
    spec = (run.config or {}).get("reward") if run is not None else None
    return spec if isinstance(spec, dict) else {}


# --- Opening: which sessions owe a reward ------------------------------------------------------


def reward_requests_open(*, now: datetime | None = None, limit: int = 500) -> int:
    """A request for every ended, unrewarded session of a judge or human run that has none."""
    now = now or timezone.now()
    sessions = (
        Session.objects.filter(
            status=S.ENDED,
            trajectory=T.UNREWARDED,
            run__isnull=False,
            run__config__reward__type__in=["judge", "human"],
            reward_request__isnull=True,
        )
        .select_related("run")
        .order_by("ended_at")[:limit]
    )
    made = []
    for session in sessions:
        spec = _reward_spec(session)
        human = spec.get("type") == "human"
        ended = session.ended_at or now
        made.append(
            RewardRequest(
                session=session,
                run=session.run,
                kind=RewardRequest.Kind.HUMAN if human else RewardRequest.Kind.JUDGE,
                group_key=str(session.metadata.get("group_id") or session.task_id or "")[:250],
                due_at=ended + timedelta(seconds=float(reward_setting(spec, "timeout_s")))
                if human
                else None,
                next_attempt_at=now,
            )
        )
    RewardRequest.objects.bulk_create(made, ignore_conflicts=True)
    return len(made)


# --- The judge -------------------------------------------------------------------------------


def _last_turn(session: Session) -> Interaction | None:
    """The session's last turn that was not aborted, with its whole conversation."""
    turns = list(session.interactions.order_by("turn"))
    deltas.expand(turns)
    kept = [t for t in turns if not t.aborted]
    return kept[-1] if kept else None


def _answer_text(turn: Interaction) -> str:
    choices = (turn.response or {}).get("choices") or []
    message = choices[turn.chosen].get("message", {}) if turn.chosen < len(choices) else {}
    text = message.get("content") or ""
    if message.get("tool_calls"):
        text += f"\n(tool calls: {message['tool_calls']})"
    return text


def _lease(*, now: datetime, limit: int) -> list[RewardRequest]:
    """Take due judge requests (whole groups for a relative judge) for one tick: another worker
    skips them, and a worker that dies mid-call leaves them due again when the lease ends."""
    with transaction.atomic():
        due = list(
            RewardRequest.objects.select_for_update(skip_locked=True)
            .filter(kind=RewardRequest.Kind.JUDGE, state=R.PENDING, next_attempt_at__lte=now)
            .order_by("next_attempt_at")[:limit]
        )
        groups = {(r.run_id, r.group_key) for r in due if r.group_key}
        extra = []
        for run_id, group_key in groups:
            extra += list(
                RewardRequest.objects.select_for_update(skip_locked=True)
                .filter(run_id=run_id, group_key=group_key, state=R.PENDING, kind="judge")
                .exclude(pk__in=[r.pk for r in due])
            )
        leased = due + extra
        for request in leased:
            spec = _reward_spec(request.run)
            lease_s = 4 * float(reward_setting(spec, "timeout_s") or 60) + 30
            RewardRequest.objects.filter(pk=request.pk).update(
                next_attempt_at=now + timedelta(seconds=lease_s)
            )
    ids = [r.pk for r in leased]
    return list(
        RewardRequest.objects.filter(pk__in=ids).select_related("run", "session").order_by("pk")
    )


def _units(requests: list[RewardRequest]) -> list[list[RewardRequest]]:
    """What one judge call scores: a relative judge's group together, otherwise one session."""
    groups: dict[tuple, list[RewardRequest]] = defaultdict(list)
    units = []
    for request in requests:
        if reward_setting(_reward_spec(request.run), "relative") and request.group_key:
            groups[(request.run_id, request.group_key)].append(request)
        else:
            units.append([request])
    return units + list(groups.values())


def judge_due(*, now: datetime | None = None, limit: int = 64) -> dict[str, int]:
    """Judge the due sessions: from the cache at no cost, else by calls, at most
    ``STEEP_JUDGE_CONCURRENCY`` at once. Returns counts of what happened."""
    now = now or timezone.now()
    counts = {"scored": 0, "unscored": 0, "waiting": 0, "cached": 0, "calls": 0}
    # digest → spec, texts, the self judge (or None), its units
    work: dict[str, tuple[dict, list[str], judge.SelfJudge | None, list]] = {}
    for unit in _units(_lease(now=now, limit=limit)):
        turns = [_last_turn(r.session) for r in unit]
        if any(t is None for t in turns):  # nothing to judge: say so rather than wait forever
            for request in unit:
                _finish_unscored(request, "the session has no turn to judge", now)
                counts["unscored"] += 1
            continue
        spec = _reward_spec(unit[0].run)
        self_judge, judge_id = None, ""
        if spec.get("judge") == "self":
            try:
                self_judge, judge_id = _self_judge(unit[0].run)
            except judge.Unavailable as exc:
                _wait(unit, str(exc), counts)
                continue
        texts = [judge.transcript(t.messages or [], _answer_text(t)) for t in turns]  # type: ignore[union-attr]
        digest = judge.content_hash(spec, texts, judge_id=judge_id)
        cached = JudgeVerdict.objects.filter(content_hash=digest).first()
        if cached is not None:
            JudgeCall.objects.create(
                run=unit[0].run, content_hash=digest, cached=True, sessions=len(unit)
            )
            _apply(unit, turns, cached.scores, cached.reasons, now)
            counts["cached"] += 1
            counts["scored"] += len(unit)
            continue
        # The same answers twice in one tick (identical rollouts): one call for both.
        work.setdefault(digest, (spec, texts, self_judge, []))[3].append((unit, turns))
    if not work:
        return counts
    digests = list(work)
    with ThreadPoolExecutor(max_workers=settings.STEEP_JUDGE_CONCURRENCY) as pool:
        results = list(
            pool.map(
                lambda d: judge.judge_answers(work[d][0], work[d][1], self_judge=work[d][2]),
                digests,
            )
        )
    for digest, result in zip(digests, results, strict=True):
        counts["calls"] += 1
        for index, (unit, turns) in enumerate(work[digest][3]):
            _judged(unit, turns, digest, result, counts, now, cached=index > 0)
    return counts


def _judged(unit, turns, digest: str, result, counts: dict, now: datetime, cached: bool) -> None:
    """Record one call (or its reuse, free) and what it means for the unit's requests."""
    JudgeCall.objects.create(
        run=unit[0].run,
        content_hash=digest,
        cached=cached,
        ok=result.verdict is not None,
        outage=result.outage,
        sessions=len(unit),
        prompt_tokens=0 if cached else result.prompt_tokens,
        completion_tokens=0 if cached else result.completion_tokens,
        latency_ms=0.0 if cached else result.latency_ms,
        error=result.error[:2000],
    )
    if result.verdict is not None:
        JudgeVerdict.objects.get_or_create(
            content_hash=digest,
            defaults={"scores": result.verdict.scores, "reasons": result.verdict.reasons},
        )
        _apply(unit, turns, result.verdict.scores, result.verdict.reasons, timezone.now())
        counts["scored"] += len(unit)
    elif result.outage:
        _wait(unit, result.error, counts)
    else:
        for request in unit:
            _finish_unscored(request, f"judge reply invalid twice: {result.error}", now)
        counts["unscored"] += len(unit)


def _wait(unit: list[RewardRequest], error: str, counts: dict) -> None:
    """No verdict for now (an outage): the sessions stay waiting, tried again with backoff."""
    for request in unit:
        attempts = request.attempts + 1
        RewardRequest.objects.filter(pk=request.pk).update(
            attempts=attempts,
            next_attempt_at=timezone.now() + timedelta(seconds=backoff_s(attempts)),
            reason=f"waiting: {error}"[:2000],
        )
    counts["waiting"] += len(unit)


_TOKENIZERS: dict[str, Any] = {}  # base model → its chat tokenizer, loaded once per worker


def _self_judge(run) -> tuple[judge.SelfJudge, str]:
    """The run's own model as its judge, and what names it in the cache: a LoRA run's base
    weights never change; a full-weight run's servers hold the policy of its version."""
    urls = list(
        InferenceServer.objects.filter(run=run, healthy=True)
        .order_by("pk")
        .values_list("url", flat=True)
    )
    if not urls:
        raise judge.Unavailable("the run has no inference server up to judge with")
    tokenizer = _TOKENIZERS.get(run.base_model)
    if tokenizer is None:
        try:
            tokenizer = _TOKENIZERS[run.base_model] = load_chat_tokenizer(run.base_model)
        except (OSError, ValueError) as exc:
            raise judge.Unavailable(
                f"cannot load the tokenizer of {run.base_model}: {exc}"
            ) from None
    lora = (run.config or {}).get("lora_rank")
    judge_id = f"self:{run.id}:{run.base_model}" + ("" if lora else f":v{run.weight_version}")
    return judge.SelfJudge(urls, tokenizer), judge_id


def _apply(unit, turns, scores: list[float], reasons: list[str], now: datetime) -> None:
    for request, turn, score, reason in zip(unit, turns, scores, reasons, strict=False):
        with transaction.atomic():
            with connection.cursor() as cursor:
                moved = lifecycle.rewarded_after_end(cursor, request.session_id)
            if moved:
                Interaction.objects.filter(pk=turn.pk).update(reward=score, rewarded_at=now)
                if reason.strip():  # the critique, unless the agent or a person gave a hint
                    Session.objects.filter(pk=request.session_id, hint="").update(
                        hint=reason.strip()[:2000]
                    )
            RewardRequest.objects.filter(pk=request.pk).update(
                state=R.SCORED,
                score=score,
                reason=reason[:2000] if moved else "rewarded otherwise before the judge answered",
                finished_at=now,
            )


def _finish_unscored(request: RewardRequest, reason: str, now: datetime) -> None:
    RewardRequest.objects.filter(pk=request.pk).update(
        state=R.UNSCORED, reason=reason[:2000], finished_at=now
    )


# --- People ----------------------------------------------------------------------------------


def human_timeouts(*, now: datetime | None = None) -> int:
    """Drop the sessions whose human reward did not come within the run's ``timeout_s``."""
    now = now or timezone.now()
    dropped = 0
    for request in RewardRequest.objects.filter(
        kind=RewardRequest.Kind.HUMAN, state=R.PENDING, due_at__lte=now
    ).select_related("run"):
        timeout = reward_setting(_reward_spec(request.run), "timeout_s")
        with transaction.atomic():
            with connection.cursor() as cursor:
                moved = lifecycle.drop_unrewarded(
                    cursor, request.session_id, reason=lifecycle.DROP_HUMAN_TIMEOUT
                )
            RewardRequest.objects.filter(pk=request.pk, state=R.PENDING).update(
                state=R.DROPPED if moved else R.SCORED,
                reason=f"no human feedback within {timeout:g} s of the session's end"
                if moved
                else "rewarded otherwise before the timeout",
                finished_at=now,
            )
        dropped += int(moved)
    return dropped


FEEDBACK_REWARD = {Feedback.Rating.UP: 1.0, Feedback.Rating.DOWN: 0.0}


def feedback_reward(*, rating: str, score: float | None) -> float | None:
    """The rule: the score given (0 to 1), else 1.0 for thumbs up and 0.0 for down; a comment
    alone is no reward."""
    if score is not None:
        return float(score)
    return FEEDBACK_REWARD.get(rating)  # type: ignore[call-overload]


def feedback_record(
    *,
    session: Session,
    interaction_id: str | None = None,
    rating: str = "",
    score: float | None = None,
    comment: str = "",
    author: Any = None,
) -> Feedback:
    """Keep a person's feedback on a session (or one turn) and make it the turn's reward while
    the trajectory is not yet claimed for training. An ended, unrewarded session becomes ready."""
    if not rating and score is None and not comment.strip():
        raise FeedbackInvalid("Give a rating (up or down), a score or a comment.")
    now = timezone.now()
    with transaction.atomic():
        locked = Session.objects.select_for_update().get(pk=session.pk)
        turns = [t for t in locked.interactions.order_by("turn") if not t.aborted]
        if interaction_id:
            turn = next((t for t in turns if t.pk == interaction_id), None)
            if turn is None:
                raise FeedbackInvalid(f"Session {session.pk} has no turn {interaction_id!r}.")
        else:
            turn = turns[-1] if turns else None
        reward = feedback_reward(rating=rating, score=score)
        # Open (rewarded when it ends), waiting for the trainer, or ended without a reward;
        # an expired session without one is never trained (``lifecycle.end``).
        rewardable = locked.trajectory in (T.PENDING, T.READY) or (
            locked.trajectory == T.UNREWARDED and locked.status == S.ENDED
        )
        applied = reward is not None and turn is not None and rewardable
        if comment.strip() and locked.trajectory in (T.PENDING, T.READY, T.UNREWARDED):
            # A self-distilling run's teacher reads it in context (rl_core.hints).
            Session.objects.filter(pk=locked.pk).update(hint=comment.strip())
        if applied:
            Interaction.objects.filter(pk=turn.pk).update(reward=reward, rewarded_at=now)  # type: ignore[union-attr]
            if locked.status == S.ENDED and locked.trajectory == T.UNREWARDED:
                with connection.cursor() as cursor:
                    lifecycle.rewarded_after_end(cursor, locked.pk)
            RewardRequest.objects.filter(
                session=locked, kind=RewardRequest.Kind.HUMAN, state=R.PENDING
            ).update(state=R.SCORED, score=reward, reason="human feedback", finished_at=now)
        return Feedback.objects.create(
            project_id=locked.project_id,
            session=locked,
            interaction=turn if interaction_id else None,
            rating=rating,
            score=score,
            comment=comment.strip(),
            reward=reward,
            reward_applied=applied,
            author=author,
            created_at=now,
        )


def reward_losses_take(*, run) -> int:
    """The run's sessions that ended unscored or dropped since the last call, counted once: a
    dataset run's job gives their staleness slots back (``StalenessController.on_unrewarded``)."""
    with transaction.atomic():
        ids = list(
            RewardRequest.objects.select_for_update(skip_locked=True)
            .filter(run=run, state__in=[R.UNSCORED, R.DROPPED], loss_reported=False)
            .values_list("pk", flat=True)
        )
        return RewardRequest.objects.filter(pk__in=ids).update(loss_reported=True)


def rewards_tick() -> dict[str, int]:
    """One pass of the worker: open requests, drop timed-out human ones, judge what is due."""
    opened = reward_requests_open()
    dropped = human_timeouts()
    return {"opened": opened, "dropped": dropped, **judge_due()}
