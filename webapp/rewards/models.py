"""Rewards given after an episode ends: what is owed (a judge's verdict, a person's feedback),
the judge's cached verdicts and what each call cost, and the feedback people gave."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class RewardRequest(models.Model):
    """A session of a judge or human run that ended without a reward, waiting for one.

    state: pending ──► scored | unscored (the judge's answer failed its schema twice) | dropped (no
    human feedback within the run's timeout). A pending judge request whose call failed
    (an outage) stays pending, tried again at ``next_attempt_at``.
    """

    class Kind(models.TextChoices):
        JUDGE = "judge"
        HUMAN = "human"

    class State(models.TextChoices):
        PENDING = "pending"
        SCORED = "scored"
        UNSCORED = "unscored"
        DROPPED = "dropped"

    session = models.OneToOneField(
        "gateway.Session", on_delete=models.CASCADE, related_name="reward_request"
    )
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="reward_requests")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    group_key = models.CharField(
        max_length=250, blank=True, help_text="Judged together when the judge is relative."
    )
    attempts = models.PositiveIntegerField(default=0, help_text="Judge calls that failed.")
    next_attempt_at = models.DateTimeField(default=timezone.now)
    due_at = models.DateTimeField(null=True, blank=True, help_text="Human: dropped after this.")
    reason = models.TextField(blank=True, help_text="Why unscored/dropped, or the last outage.")
    score = models.FloatField(null=True, blank=True)
    loss_reported = models.BooleanField(
        default=False, help_text="Unscored/dropped, and the run's job has been told."
    )
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["kind", "state", "next_attempt_at"]),
            models.Index(fields=["run", "state"]),
        ]

    def __str__(self) -> str:
        return f"{self.kind} reward for session {self.session_id}: {self.state}"


class JudgeVerdict(models.Model):
    """A judge's validated answer, by the hash of everything that decided it (the cache)."""

    content_hash = models.CharField(max_length=64, unique=True)
    scores = models.JSONField(help_text="One score per judged answer, in order.")
    reasons = models.JSONField(default=list)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"verdict {self.content_hash[:12]}"


class JudgeCall(models.Model):
    """What judging cost a run: one row per call made (or answered from the cache, at no cost)."""

    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="judge_calls")
    content_hash = models.CharField(max_length=64)
    cached = models.BooleanField(default=False)
    ok = models.BooleanField(default=True, help_text="A valid verdict came back.")
    outage = models.BooleanField(default=False, help_text="No verdict: the judge was unreachable.")
    sessions = models.PositiveIntegerField(default=1, help_text="Answers judged by the call.")
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    latency_ms = models.FloatField(default=0.0)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["run", "created_at"])]

    def __str__(self) -> str:
        return f"judge call {self.content_hash[:12]}{' (cached)' if self.cached else ''}"


class Feedback(models.Model):
    """A person's verdict on a session or one of its turns (``interaction`` empty: the session)."""

    class Rating(models.TextChoices):
        UP = "up"
        DOWN = "down"

    project = models.ForeignKey(
        "accounts.Project", on_delete=models.CASCADE, related_name="feedback"
    )
    session = models.ForeignKey(
        "gateway.Session", on_delete=models.CASCADE, related_name="feedback"
    )
    interaction = models.ForeignKey(
        "gateway.Interaction",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="feedback",
    )
    rating = models.CharField(max_length=4, choices=Rating.choices, blank=True)
    score = models.FloatField(null=True, blank=True)
    comment = models.TextField(blank=True)
    reward = models.FloatField(null=True, blank=True, help_text="What the rule made of it.")
    reward_applied = models.BooleanField(default=False)
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["session", "created_at"])]

    def __str__(self) -> str:
        return f"feedback on session {self.session_id}"
