from __future__ import annotations

from datetime import datetime

from django.db.models import Min, QuerySet
from django.http import Http404

from webapp.accounts.models import Project
from webapp.accounts.selectors import parse_uuid
from webapp.runs.models import Checkpoint, MetricPoint, Run, RunEvent


def run_list(*, project: Project, status: str | None = None) -> QuerySet[Run]:
    runs = Run.objects.filter(project=project).select_related("dataset")
    if status:
        runs = runs.filter(status=status)
    return runs.order_by("-created_at")


def run_get(*, project: Project, run_id) -> Run:
    run = (
        Run.objects.filter(project=project, pk=parse_uuid(run_id)).select_related("dataset").first()
    )
    if run is None:
        raise Http404("Run not found.")
    return run


def metric_list(
    *, run: Run, name: str | None = None, since_step: int | None = None
) -> QuerySet[MetricPoint]:
    points = MetricPoint.objects.filter(run=run)
    if name:
        points = points.filter(name=name)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    return points.order_by("step", "name")


def metric_points(*, run: Run) -> list[tuple[int, str, float, datetime]]:
    """Every metric point of the run as ``(step, name, value, created_at)``, in step order."""
    return list(
        MetricPoint.objects.filter(run=run)
        .order_by("step", "name")
        .values_list("step", "name", "value", "created_at")
    )


def checkpoint_list(*, run: Run) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(run=run).order_by("-version")


def run_event_list(*, run: Run) -> QuerySet[RunEvent]:
    """The run's events, newest first."""
    return RunEvent.objects.filter(run=run).order_by("-created_at", "-id")


def metric_step_times(*, run: Run, last: int) -> list[tuple[int, float]]:
    """When each of the run's last ``last`` steps was first reported: ``[(step, unix seconds)]``, oldest first."""
    rows = (
        MetricPoint.objects.filter(run=run)
        .values("step")
        .annotate(at=Min("created_at"))
        .order_by("-step")[:last]
    )
    return sorted((row["step"], row["at"].timestamp()) for row in rows)
