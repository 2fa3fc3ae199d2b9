from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from django.conf import settings
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


def checkpoint_for_step(*, run: Run, step: int) -> Checkpoint | None:
    """The run's checkpoint saved at ``step``, if any."""
    return Checkpoint.objects.filter(run=run, step=step).order_by("-version").first()


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


@dataclass(frozen=True)
class KnownModel:
    name: str  # what base_model takes: a local directory (or a Hugging Face id)
    source: str  # "demo" | "project" (a run of the project uses it) | "models_dir"


def known_models(*, project: Project) -> list[KnownModel]:
    """The models this instance knows, to offer as ``base_model``: the demo model, those the
    project's runs use (newest first), and the model directories in ``DATA_DIR/models``."""
    found: list[KnownModel] = []
    demo = settings.STEEP_DEMO_MODEL
    if Path(demo).is_dir() or not demo.startswith(("/", ".")):
        found.append(KnownModel(demo, "demo"))
    for name in (
        Run.objects.filter(project=project)
        .order_by("-created_at")
        .values_list("base_model", flat=True)[:200]
    ):
        found.append(KnownModel(name, "project"))
    models_dir = Path(settings.DATA_DIR) / "models"
    if models_dir.is_dir():
        for config in sorted(models_dir.glob("*/config.json")):
            found.append(KnownModel(str(config.parent), "models_dir"))
    unique: dict[str, KnownModel] = {}
    for model in found:
        unique.setdefault(model.name, model)  # the first source named wins
    return list(unique.values())
