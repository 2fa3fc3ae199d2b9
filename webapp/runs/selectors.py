from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.db.models import (
    Avg,
    ExpressionWrapper,
    F,
    IntegerField,
    Max,
    Min,
    OuterRef,
    QuerySet,
    Subquery,
)
from django.http import Http404

from rl_core.sources import SourceRefused, model_source
from webapp.accounts.models import Project
from webapp.accounts.selectors import parse_uuid
from webapp.runs.models import Checkpoint, MetricPoint, Run, RunEvent
from webapp.runs.sources import source_rules

REWARD_METRIC = "rollout/reward"


def run_list(*, project: Project, status: str | None = None) -> QuerySet[Run]:
    runs = Run.objects.filter(project=project).select_related("dataset")
    if status:
        runs = runs.filter(status=status)
    return runs.order_by("-created_at")


def run_list_with_reward(*, project: Project) -> QuerySet[Run]:
    """The project's runs, newest first, each with ``reward``: its latest ``rollout/reward``
    (None before the first step), fetched in the same query as the runs."""
    latest = MetricPoint.objects.filter(run=OuterRef("pk"), name=REWARD_METRIC).order_by("-step")
    return run_list(project=project).annotate(reward=Subquery(latest.values("value")[:1]))


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


def metric_values(*, run: Run, name: str, since_step: int) -> list[float]:
    """The values of one metric after ``since_step``, in step order."""
    points = metric_list(run=run, name=name, since_step=since_step)
    return list(points.values_list("value", flat=True))


def metric_points(*, run: Run, stride: int = 1) -> list[tuple[int, str, float, datetime]]:
    """The run's metric points as ``(step, name, value, created_at)``, in step order.

    ``stride`` > 1 averages each metric over buckets of ``stride`` steps (steps
    ``[k * stride, (k + 1) * stride)``), each shown at its last step and first time: a long
    run's page then carries a bounded number of points without hiding a trend.
    """
    points = MetricPoint.objects.filter(run=run)
    if stride <= 1:
        return list(
            points.order_by("step", "name").values_list("step", "name", "value", "created_at")
        )
    bucket = ExpressionWrapper(F("step") / stride, output_field=IntegerField())
    return [
        (row["last"], row["name"], row["mean"], row["first"])
        for row in points.annotate(bucket=bucket)
        .values("bucket", "name")
        .annotate(last=Max("step"), mean=Avg("value"), first=Min("created_at"))
        .order_by("last", "name")
    ]


def metric_latest(*, run: Run) -> list[tuple[int, str, float]]:
    """Each metric's last point ``(step, name, value)``, by name."""
    last_steps = MetricPoint.objects.filter(run=run, name=OuterRef("name")).order_by("-step")
    return list(
        MetricPoint.objects.filter(run=run, step=Subquery(last_steps.values("step")[:1]))
        .order_by("name")
        .values_list("step", "name", "value")
    )


def checkpoint_list(*, run: Run) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(run=run).order_by("-version")


def project_checkpoint_list(*, project: Project, limit: int = 200) -> QuerySet[Checkpoint]:
    """The project's checkpoints, newest first: what a new run may start from (init_checkpoint)."""
    return (
        Checkpoint.objects.filter(run__project=project)
        .select_related("run")
        .order_by("-created_at", "-pk")[:limit]
    )


def checkpoint_get(*, run: Run, checkpoint_id) -> Checkpoint:
    """One of the run's checkpoints by id; another run's (or project's) answers 404."""
    try:
        pk = int(checkpoint_id)
    except (TypeError, ValueError):
        raise Http404("Checkpoint not found.") from None
    checkpoint = Checkpoint.objects.filter(run=run, pk=pk).select_related("run").first()
    if checkpoint is None:
        raise Http404("Checkpoint not found.")
    return checkpoint


def checkpoint_for_step(*, run: Run, step: int) -> Checkpoint | None:
    """The run's checkpoint saved at ``step``, if any."""
    return Checkpoint.objects.filter(run=run, step=step).order_by("-version").first()


def run_event_list(*, run: Run) -> QuerySet[RunEvent]:
    """The run's events, newest first."""
    return RunEvent.objects.filter(run=run).order_by("-created_at", "-id")


def run_last_restart(*, run: Run) -> RunEvent | None:
    """The latest restart of the run's job from a checkpoint (or from version 0), if any."""
    return run_event_list(run=run).filter(kind=RunEvent.RESUME).first()


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
    name: str  # what base_model takes: a model directory (or a Hugging Face id)
    source: str  # "demo" | "project" (a run of the project uses it) | "models_dir"


def known_models(*, project: Project) -> list[KnownModel]:
    """The models this instance offers ``project`` as ``base_model``: the demo model, those the
    project's runs use (newest first) that the instance's rules still allow, and the model
    directories under the model roots (``STEEP_MODEL_ROOTS``, default ``DATA_DIR/models``)."""
    rules = source_rules()
    found: list[KnownModel] = []
    demo = settings.STEEP_DEMO_MODEL
    if Path(demo).is_dir() or not demo.startswith(("/", ".")):
        found.append(KnownModel(demo, "demo"))
    for name in (
        Run.objects.filter(project=project)
        .order_by("-created_at")
        .values_list("base_model", flat=True)[:200]
    ):
        try:
            if model_source(name, rules) == name:
                found.append(KnownModel(name, "project"))
        except SourceRefused:
            pass  # named before the rules, or no longer offered
    for root in map(Path, rules.model_roots):
        if root.is_dir():
            for config in sorted(root.glob("*/config.json")):
                found.append(KnownModel(str(config.parent), "models_dir"))
    unique: dict[str, KnownModel] = {}
    for model in found:
        unique.setdefault(model.name, model)  # the first source named wins
    return list(unique.values())
