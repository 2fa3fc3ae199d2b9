"""Inference pools: long-lived servers for one base model that many LoRA runs share.

A pool belongs to the platform, not to a project: its operators (staff) create and scale
it; runs of any project attach to it by name (``RunConfig.inference_pool``). Its servers
are started by a Ray job of its own (``workers.pool_job``), independent of any run.
"""

from __future__ import annotations

import uuid

from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

POOL_NAME = RegexValidator(
    r"^[a-z0-9][a-z0-9-]{0,62}$",
    "A pool name is 1-63 lowercase letters, digits and dashes, starting with a letter or digit.",
)


class Pool(models.Model):
    """A set of inference servers for one base model, serving attached runs' adapters."""

    class Status(models.TextChoices):
        STOPPED = "stopped"  # created, or stopped: no servers
        STARTING = "starting"  # its job is submitted; servers are coming up
        RUNNING = "running"  # at least one server is up
        STOPPING = "stopping"  # its job was asked to stop its servers
        FAILED = "failed"  # its job failed; ``error`` says why
        # Steep was stopped cleanly (./steep up's Ctrl-C) under it: it starts again with Steep.
        INTERRUPTED = "interrupted"

    class Backend(models.TextChoices):
        AUTO = "auto"
        TORCH = "torch"
        SGLANG = "sglang"
        VLLM = "vllm"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=63, unique=True, validators=[POOL_NAME])
    base_model = models.CharField(max_length=500)
    backend = models.CharField(max_length=10, choices=Backend.choices, default=Backend.AUTO)
    replicas = models.PositiveIntegerField(
        default=1, help_text="Servers the pool should run (one placement group each)."
    )
    tensor_parallel = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1)],
        help_text="GPUs per server (SGLang's --tp-size, vLLM's --tensor-parallel-size); 1 on CPUs.",
    )
    status = models.CharField(
        max_length=20, choices=Status.choices, default=Status.STOPPED, db_index=True
    )
    max_lora_rank = models.PositiveIntegerField(
        default=64,
        validators=[MinValueValidator(1)],
        help_text="The highest LoRA rank an attached run may train (SGLang's --max-lora-rank).",
    )
    lora_target_modules = models.JSONField(
        default=list,
        blank=True,
        help_text="Modules adapters may target (SGLang's --lora-target-modules); empty: all linear layers.",
    )
    max_loaded_adapters = models.PositiveIntegerField(
        default=8,
        validators=[MinValueValidator(1)],
        help_text="Adapters one server keeps loaded and batches together (--max-loaded-loras, "
        "--max-loras-per-batch); past it the least recently used idle one is evicted and "
        "reloaded when its run's next request comes.",
    )
    max_sessions_per_run = models.PositiveIntegerField(
        default=0, help_text="Open sessions one attached run may hold in the pool (0: no limit)."
    )
    max_requests_per_run = models.PositiveIntegerField(
        default=0,
        help_text="Generation requests one attached run may have in flight (0: no limit).",
    )
    run_weights = models.JSONField(
        default=dict,
        blank=True,
        help_text="Each attached run's weight (by run id) in the servers' fair share of the batch; "
        "runs not named weigh 1 (torch engine servers; applied within 30 s).",
    )
    error = models.TextField(blank=True)
    job_id = models.CharField(max_length=200, blank=True)
    job_secret_hash = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        weights = self.run_weights
        if not isinstance(weights, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
            for v in weights.values()
        ):
            raise ValidationError(
                {
                    "run_weights": 'Give {"<run id>": <positive number>, ...}; a run not named weighs 1.'
                }
            )


class PoolServer(models.Model):
    """One server of a pool, as its job registered it."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="servers")
    url = models.CharField(max_length=300)
    backend = models.CharField(max_length=20)
    registered_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["registered_at", "id"]
        constraints = [models.UniqueConstraint(fields=["pool", "url"], name="unique_pool_server")]

    def __str__(self) -> str:
        return self.url
