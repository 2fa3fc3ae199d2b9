from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone


class Run(models.Model):
    """A training run. Its settings are a validated ``rl_core.config.RunConfig`` stored in ``config``."""

    class Status(models.TextChoices):
        DRAFT = "draft"
        QUEUED = "queued"
        STARTING = "starting"
        RUNNING = "running"
        STOPPING = "stopping"
        STOPPED = "stopped"
        COMPLETED = "completed"
        FAILED = "failed"
        # Steep itself was stopped cleanly (Ctrl-C on ./steep up) while the run was active:
        # not the run's fault; it resumes from its last checkpoint at the next start.
        INTERRUPTED = "interrupted"

    class Mode(models.TextChoices):
        ONLINE = "online"
        DATASET = "dataset"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    project = models.ForeignKey("accounts.Project", on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=200)
    mode = models.CharField(max_length=10, choices=Mode.choices)
    base_model = models.CharField(max_length=500)
    dataset = models.ForeignKey(
        "datasets.Dataset", null=True, blank=True, on_delete=models.PROTECT, related_name="runs"
    )
    config = models.JSONField(default=dict)
    status = models.CharField(
        max_length=20, choices=Status.choices, default=Status.DRAFT, db_index=True
    )
    step = models.PositiveIntegerField(default=0)
    weight_version = models.PositiveIntegerField(default=0)
    # The gateway's staleness admission reads these instead of counting sessions: open
    # sessions (rollouts running) and trajectories accepted for training (ready, claimed or
    # trained; dropped ones give their slot back). Moved with every session move by
    # webapp.gateway.lifecycle; recomputed from the sessions by the periodic
    # sessions.expire_idle task (webapp.gateway.admission.refresh), for deleted sessions.
    sessions_open = models.IntegerField(default=0)
    sessions_accepted = models.IntegerField(default=0)
    error = models.TextField(blank=True)
    # Why a queued run waits instead of starting (webapp.runs.queueing), e.g. "waiting for 1 GPU
    # for the trainer: 0 of 1 free; pool shared holds 1"; empty otherwise. The reconciler
    # launches it when the cluster has room.
    queue_reason = models.CharField(max_length=500, blank=True)
    # The Ray job executing the run. Its secret (hashed) authenticates the internal API;
    # a new one is issued at every launch, so a previous attempt's job is locked out.
    job_id = models.CharField(max_length=200, blank=True)
    job_attempt = models.PositiveIntegerField(default=0)
    job_secret_hash = models.CharField(max_length=64, blank=True)
    job_log_tail = models.TextField(blank=True)
    # Relaunches after a crash (the reconciler's) since the run was last started by hand;
    # RUN_MAX_RESTARTS bounds it. Resuming an interrupted run does not count.
    crash_restarts = models.PositiveIntegerField(default=0)
    # An operator created the run past the instance's rules on purpose (a management command's
    # --unrestricted): its launch does not check them again (webapp.runs.sources).
    sources_unrestricted = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_active(self) -> bool:
        return self.status in {
            self.Status.QUEUED,
            self.Status.STARTING,
            self.Status.RUNNING,
            self.Status.STOPPING,
        }


class RunEvent(models.Model):
    """A line in a run's history: transitions, launches, errors."""

    RESUME = "resume"  # where a restarted job took the run back to (the run page shows the last)

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=40)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class MetricPoint(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metrics")
    step = models.PositiveIntegerField()
    name = models.CharField(max_length=100)
    value = models.FloatField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["step", "name"]
        indexes = [models.Index(fields=["run", "name", "step"])]
        constraints = [
            models.UniqueConstraint(fields=["run", "name", "step"], name="unique_metric_point")
        ]

    def __str__(self) -> str:
        return f"{self.name}@{self.step}={self.value}"


class Checkpoint(models.Model):
    """A checkpoint the run's job saved, and its export (a standalone model folder, see
    ``webapp.runs.exporting``): none → running → done | failed; failed or done may run again."""

    class ExportStatus(models.TextChoices):
        NONE = "none"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    version = models.PositiveIntegerField()
    step = models.PositiveIntegerField(default=0)
    path = models.CharField(max_length=500)
    size_bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    export_status = models.CharField(
        max_length=10, choices=ExportStatus.choices, default=ExportStatus.NONE
    )
    export_path = models.CharField(max_length=500, blank=True)
    export_error = models.TextField(blank=True)
    export_started_at = models.DateTimeField(null=True, blank=True)
    export_finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-version"]
        constraints = [
            models.UniqueConstraint(fields=["run", "version"], name="unique_checkpoint_version")
        ]

    def __str__(self) -> str:
        return f"{self.run} v{self.version}"


class ClusterReport(models.Model):
    """The Ray cluster's resources as a run's job last counted them (``ray.cluster_resources()``).

    One row (the cluster Steep submits to), replaced by every report; new runs are
    checked against it (``webapp.runs.services.run_create``).
    """

    gpus = models.FloatField()
    cpus = models.FloatField()
    reported_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.gpus:g} GPUs, {self.cpus:g} CPUs at {self.reported_at:%Y-%m-%d %H:%M}"
