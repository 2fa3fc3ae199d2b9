from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone


class Eval(models.Model):
    """One model of a run (its base model or a checkpoint) scored on dataset rows with the
    run's reward: queued → running → done | failed (``webapp.evals.services``)."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    class Split(models.TextChoices):
        HELD_OUT = "held_out"  # the rows eval_fraction keeps out of training
        ALL = "all"  # every row of the dataset

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    project = models.ForeignKey("accounts.Project", on_delete=models.CASCADE, related_name="evals")
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="evals")
    checkpoint = models.ForeignKey(
        "runs.Checkpoint",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="evals",
        help_text="Empty: the run's base model.",
    )
    step = models.PositiveIntegerField(default=0, help_text="The checkpoint's step; 0: base.")
    dataset = models.ForeignKey("datasets.Dataset", on_delete=models.CASCADE, related_name="evals")
    split = models.CharField(max_length=10, choices=Split.choices, default=Split.HELD_OUT)
    scheduled = models.BooleanField(
        default=False, help_text="Started by the run's eval_every, not by hand."
    )
    k = models.PositiveIntegerField()
    max_examples = models.PositiveIntegerField(default=0, help_text="0: every row.")
    pass_threshold = models.FloatField()
    max_new_tokens = models.PositiveIntegerField()
    temperature = models.FloatField()
    top_p = models.FloatField(default=1.0, help_text="Nucleus sampling mass (the run's); 1: none.")
    status = models.CharField(
        max_length=10, choices=Status.choices, default=Status.QUEUED, db_index=True
    )
    progress_done = models.PositiveIntegerField(default=0)
    progress_total = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True)
    examples = models.PositiveIntegerField(default=0)
    mean_reward = models.FloatField(null=True, blank=True)
    mean_reward_low = models.FloatField(null=True, blank=True)
    mean_reward_high = models.FloatField(null=True, blank=True)
    pass_at_k = models.FloatField(null=True, blank=True)
    pass_at_k_low = models.FloatField(null=True, blank=True)
    pass_at_k_high = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # While running, the worker executing it writes this every EVAL_HEARTBEAT_S; one gone
    # silent (the worker killed) is queued again (evals.services.eval_reconcile).
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0, help_text="Starts so far, retries included.")

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["run", "status"])]

    def __str__(self) -> str:
        return f"eval of {self.model_label}"

    @property
    def model_label(self) -> str:
        return "base model" if self.checkpoint_id is None else f"step {self.step}"


class EvalExample(models.Model):
    """One evaluated row: the k answers and their rewards."""

    eval = models.ForeignKey(Eval, on_delete=models.CASCADE, related_name="results")
    index = models.PositiveIntegerField(help_text="Position among the evaluated rows.")
    messages = models.JSONField()
    answer = models.JSONField(null=True, blank=True)
    completions = models.JSONField()
    rewards = models.JSONField()
    errors = models.JSONField(default=list)
    mean_reward = models.FloatField()
    pass_at_k = models.FloatField()

    class Meta:
        ordering = ["eval", "index"]
        constraints = [
            models.UniqueConstraint(fields=["eval", "index"], name="unique_eval_example")
        ]

    def __str__(self) -> str:
        return f"{self.eval_id}#{self.index}"
