from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class Agent(models.Model):
    """An agent's identity: its base_url routes OpenAI-compatible calls to its run's policy."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    project = models.ForeignKey("accounts.Project", on_delete=models.CASCADE, related_name="agents")
    run = models.ForeignKey(
        "runs.Run", null=True, blank=True, on_delete=models.SET_NULL, related_name="agents"
    )
    name = models.CharField(max_length=200)
    # The role it plays in a multi-agent run (RunConfig.roles); "" = none bound (a request may
    # still name one with model "policy/<role>").
    role = models.CharField(max_length=32, blank=True, default="", db_default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name

    @property
    def base_url(self) -> str:
        return f"{settings.SITE_URL}/agents/{self.id}/v1"
