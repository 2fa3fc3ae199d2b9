from __future__ import annotations

import json
from collections.abc import Iterator

from django.db.models import QuerySet
from django.http import Http404

from webapp.accounts.models import Project
from webapp.accounts.selectors import parse_uuid
from webapp.datasets.models import Dataset


def dataset_list(*, project: Project) -> QuerySet[Dataset]:
    return Dataset.objects.filter(project=project).order_by("-created_at")


def dataset_get(*, project: Project, dataset_id) -> Dataset:
    dataset = Dataset.objects.filter(project=project, pk=parse_uuid(dataset_id)).first()
    if dataset is None:
        raise Http404("Dataset not found.")
    return dataset


def dataset_rows(*, dataset: Dataset, offset: int = 0, limit: int | None = None) -> Iterator[dict]:
    with open(dataset.path, encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if index < offset:
                continue
            if limit is not None and index >= offset + limit:
                break
            yield json.loads(line)
