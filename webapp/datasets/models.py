from __future__ import annotations

import uuid
from pathlib import Path

from django.conf import settings
from django.db import models
from django.utils import timezone


class Dataset(models.Model):
    """A validated JSONL file of prompts. Rows live in a normalised file under DATA_DIR."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    project = models.ForeignKey(
        "accounts.Project", on_delete=models.CASCADE, related_name="datasets"
    )
    name = models.CharField(max_length=200)
    row_count = models.PositiveIntegerField(default=0)
    size_bytes = models.PositiveBigIntegerField(default=0)
    file = models.CharField(max_length=500, help_text="Path relative to DATA_DIR.")
    preview = models.JSONField(default=list)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["project", "name"], name="unique_dataset_name")
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def path(self) -> Path:
        return Path(settings.DATA_DIR) / self.file
