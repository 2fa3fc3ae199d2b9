"""Reads: what rewards cost a run and what is still owed, and the project's review queue."""

from __future__ import annotations

from django.db.models import Count, Q, Sum

from webapp.accounts.models import Project
from webapp.gateway.models import Session
from webapp.rewards.models import Feedback, JudgeCall, RewardRequest
from webapp.runs.models import Run

R = RewardRequest.State


def reward_summary(*, run: Run) -> dict | None:
    """The run page's rewards panel; None for a run with nothing to show."""
    kind = ((run.config or {}).get("reward") or {}).get("type")
    feedback = Feedback.objects.filter(session__run=run).count()
    if kind not in ("judge", "human") and not feedback:
        return None
    requests = RewardRequest.objects.filter(run=run)
    by_state = dict(requests.values_list("state").annotate(n=Count("id")))
    calls = JudgeCall.objects.filter(run=run).aggregate(
        calls=Count("id", filter=Q(cached=False)),
        cache_hits=Count("id", filter=Q(cached=True)),
        outages=Count("id", filter=Q(outage=True)),
        prompt_tokens=Sum("prompt_tokens"),
        completion_tokens=Sum("completion_tokens"),
        latency_ms=Sum("latency_ms"),
    )
    made = calls["calls"] or 0
    return {
        "kind": kind,
        "pending": by_state.get(R.PENDING, 0),
        "scored": by_state.get(R.SCORED, 0),
        "unscored": by_state.get(R.UNSCORED, 0),
        "dropped": by_state.get(R.DROPPED, 0),
        "reasons": list(
            requests.filter(state__in=[R.UNSCORED, R.DROPPED])
            .values("state", "reason")
            .annotate(n=Count("id"))
            .order_by("-n")[:5]
        ),
        "waiting": list(
            requests.filter(state=R.PENDING)
            .exclude(reason="")
            .values("reason")
            .annotate(n=Count("id"))
            .order_by("-n")[:3]
        ),
        "calls": made,
        "cache_hits": calls["cache_hits"] or 0,
        "outages": calls["outages"] or 0,
        "prompt_tokens": calls["prompt_tokens"] or 0,
        "completion_tokens": calls["completion_tokens"] or 0,
        "latency_ms": calls["latency_ms"] or 0.0,
        "mean_latency_ms": (calls["latency_ms"] or 0.0) / made if made else None,
        "feedback": feedback,
    }


def review_queue(*, project: Project):
    """Sessions of the project waiting for a person's feedback, the soonest to time out first."""
    return (
        RewardRequest.objects.filter(
            run__project=project, kind=RewardRequest.Kind.HUMAN, state=R.PENDING
        )
        .select_related("session", "run", "session__agent")
        .order_by("due_at", "pk")
    )


def session_feedback(*, session: Session) -> list[Feedback]:
    return list(session.feedback.select_related("interaction", "author").order_by("-created_at"))


def session_feedback_list(*, session: Session):
    """The session's feedback as a queryset, newest first (the REST list pages it)."""
    return session.feedback.select_related("session").order_by("-created_at", "-pk")
