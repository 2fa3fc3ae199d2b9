"""Dataset uploads: validate every line, then store atomically (all rows or nothing)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from webapp.accounts.models import Project
from webapp.datasets.importing import UnreadableUpload, upload_lines
from webapp.datasets.models import Dataset
from webapp.datasets.validation import ValidationReport, validate_lines

PREVIEW_ROWS = 5


class DatasetInvalid(Exception):
    def __init__(self, report: ValidationReport):
        self.report = report
        super().__init__(f"{report.bad_lines} invalid line(s)")


class DatasetTooLarge(Exception):
    def __init__(self, size: int, limit: int):
        self.size, self.limit = size, limit
        super().__init__(
            f"The file is {size} bytes; the limit is {limit} bytes (DATASET_MAX_BYTES)."
        )


class DatasetNameTaken(Exception):
    pass


class DatasetInUse(Exception):
    pass


def _dataset_dir(project: Project) -> Path:
    path = Path(settings.DATA_DIR) / "datasets" / str(project.id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def dataset_create(*, project: Project, name: str, file, user=None) -> Dataset:
    """Validate ``file`` (a Django UploadedFile or binary file: JSONL, or a trajectory export
    as JSONL or Parquet, see ``importing``) and store it.

    Raises DatasetTooLarge, DatasetInvalid (with line-numbered errors) or
    DatasetNameTaken; on any error nothing is stored.
    """
    size = getattr(file, "size", None)
    if size is not None and size > settings.DATASET_MAX_BYTES:
        raise DatasetTooLarge(size, settings.DATASET_MAX_BYTES)
    if Dataset.objects.filter(project=project, name=name).exists():
        raise DatasetNameTaken(name)

    directory = _dataset_dir(project)
    dataset_id = uuid.uuid4()
    final = directory / f"{dataset_id}.jsonl"
    partial = directory / f".{dataset_id}.partial"
    report = ValidationReport()
    preview: list[dict] = []
    written = 0
    try:
        with open(partial, "w", encoding="utf-8") as out:
            try:
                for row in validate_lines(upload_lines(file), report):
                    line = json.dumps(row, ensure_ascii=False) + "\n"
                    written += len(line.encode())
                    out.write(line)
                    if len(preview) < PREVIEW_ROWS:
                        preview.append(row)
            except UnreadableUpload as exc:
                report.add_error(1, str(exc))
            out.flush()
            os.fsync(out.fileno())
        if report.bad_lines:
            raise DatasetInvalid(report)
        if report.rows == 0:
            report.add_error(1, "the file has no rows")
            raise DatasetInvalid(report)
        os.replace(partial, final)
        try:
            with transaction.atomic():
                return Dataset.objects.create(
                    id=dataset_id,
                    project=project,
                    name=name,
                    row_count=report.rows,
                    size_bytes=written,
                    file=str(final.relative_to(settings.DATA_DIR)),
                    preview=preview,
                    created_by=user if getattr(user, "pk", None) else None,
                )
        except IntegrityError:
            final.unlink(missing_ok=True)
            raise DatasetNameTaken(name) from None
    finally:
        partial.unlink(missing_ok=True)


def dataset_delete(*, dataset: Dataset) -> None:
    if dataset.runs.exists():
        names = ", ".join(dataset.runs.values_list("name", flat=True)[:5])
        raise DatasetInUse(
            f"Dataset '{dataset.name}' is used by run(s): {names}. Delete those runs first."
        )
    path = dataset.path
    dataset.delete()
    transaction.on_commit(lambda: path.unlink(missing_ok=True))
