"""The run page's charts and progress line: which metric goes where (the headline, the key
panels, a folded group), the data the page starts from, and the ETA or pace. Pure functions
over the run's metric points; static/run_live.js draws the charts and keeps them live with the
same rules (sent to it as JSON by ``client_config``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

HEADLINE = "rollout/reward"  # drawn large at the top, beside any eval/ metrics
EVAL_PREFIX = "eval/"
# The handful of panels that say how training goes, right under the reward, in this order
# (those the run reports): how far each update moves the policy (KL, clipped share; a
# distillation run's reverse KL to its teacher), how old the trained samples are, throughput
# and the step's wall time. A person can pin more (run_live.js keeps pins in localStorage).
KEY_METRICS = (
    "ppo/approx_kl",
    "ppo/clip_frac",
    "distill/reverse_kl",
    "staleness/mean",
    "perf/tokens_per_s",
    "timing/step",
)
# Counters that grow with the step: drawn against the step they are a diagonal line, so they
# are only in the latest-values table.
NOT_PLOTTED = ("step", "version", "staleness/version", "eval/step")
# The rest is folded by group: the metric name's prefix (``ppo/clip_frac`` → ``ppo``). Known
# prefixes get a title and come first, in this order; others follow by name (titled by their
# prefix, ``my_tool/`` → "My tool"), then names without a prefix ("other").
GROUPS: dict[str, str] = {
    "rollout": "Rollout",
    "ppo": "Policy (PPO)",
    "loss": "Loss",
    "correction": "Rollout correction",  # rl_core.correction: engine vs trainer logprobs
    "distill": "Distillation",  # rl_core.distill: teacher calls, latency, reverse/top-k KL
    "staleness": "Staleness",
    "weight_sync": "Weight sync",
    "perf": "Throughput",
    "timing": "Timing",
    "sessions": "Sessions",
    "system": "System",
}
OTHER_GROUP = ("other", "Other")
# A multi-agent run's per-role metrics, ``roles/<role>/<name>`` (rl_core: one adapter per role):
# drawn in the Roles section, a column per role, its reward first.
ROLES_PREFIX = "roles/"
ROLE_FIRST = "reward"
# Chart points per metric a run page starts with: above this many steps, each point is the
# mean of a bucket of steps (webapp.runs.selectors.metric_points); live points come per step.
CHART_MAX_POINTS = 1000
ETA_WINDOW = 10  # step intervals the ETA averages over (their median: a pause does not skew it)
# max_steps at or above this is "until stopped" (the online demo's 1,000,000): no bar, no ETA.
UNBOUNDED_STEPS = 1_000_000
# An ETA further out than this is no forecast either: the page shows the pace instead.
ETA_HORIZON_S = 30 * 24 * 3600


@dataclass
class Group:
    id: str
    title: str
    charts: list[str] = field(default_factory=list)  # series that vary
    constants: list[tuple[str, str]] = field(default_factory=list)  # (name, value) of the rest


@dataclass
class RoleColumn:
    role: str
    charts: list[str]  # its ``roles/<role>/...`` metrics, the reward first


@dataclass
class ChartLayout:
    headline: list[str]  # rollout/reward, then eval/ metrics; empty before the first step
    key: list[str]  # KEY_METRICS the run reports, in that order
    groups: list[Group]  # only groups that have metrics
    roles: list[RoleColumn] = field(default_factory=list)  # a multi-agent run's, side by side


def role_of(name: str) -> str | None:
    """The role of a ``roles/<role>/<name>`` metric; None for any other metric."""
    if not name.startswith(ROLES_PREFIX):
        return None
    role, slash, rest = name[len(ROLES_PREFIX) :].partition("/")
    return role if role and slash and rest else None


def role_columns(names: Sequence[str], roles: Sequence[str] = ()) -> list[RoleColumn]:
    """The per-role metrics among ``names`` as one column per role: the run's ``roles`` in its
    order, then any other reporting role by name; within a column the reward first."""
    found: dict[str, list[str]] = {}
    for name in names:
        role = role_of(name)
        if role is not None:
            found.setdefault(role, []).append(name)
    order = [r for r in roles if r in found] + sorted(set(found) - set(roles))
    return [
        RoleColumn(
            role,
            sorted(
                found[role],
                key=lambda n: (n != f"{ROLES_PREFIX}{role}/{ROLE_FIRST}", n),
            ),
        )
        for role in order
    ]


def group_of(name: str) -> tuple[str, str]:
    """``(id, title)`` of the folded group ``name`` goes in: its prefix before the first ``/``."""
    if "/" not in name:
        return OTHER_GROUP
    prefix = name.split("/", 1)[0]
    return prefix, GROUPS.get(prefix) or prefix.replace("_", " ").capitalize()


def _group_order(group_id: str) -> tuple[int, int, str]:
    if group_id in GROUPS:
        return 0, list(GROUPS).index(group_id), ""
    return (2, 0, "") if group_id == OTHER_GROUP[0] else (1, 0, group_id)


def is_constant(values: Sequence[float]) -> bool:
    """Every value the same (to a part in a billion: the stored values are rounded)."""
    return bool(values) and max(values) - min(values) <= abs(max(values)) * 1e-9


def chart_layout(
    series: Mapping[str, Sequence[Sequence[float]]], roles: Sequence[str] = ()
) -> ChartLayout:
    """Where each metric of ``series`` (``{name: [steps, values]}``, as ``series()`` returns)
    goes: the headline, the key panels, a role's column (``role_columns``; ``roles``: the
    run's), or its folded group, as a chart or, for a series that never changed, as one line
    with its value."""
    names = sorted(set(series) - set(NOT_PLOTTED))
    columns = role_columns(names, roles)
    names = [n for n in names if role_of(n) is None]
    headline = [HEADLINE] if HEADLINE in names else []
    headline += [n for n in names if n.startswith(EVAL_PREFIX)]
    key = [n for n in KEY_METRICS if n in names]
    groups: dict[str, Group] = {}
    for name in names:
        if name in headline or name in key:
            continue
        group = groups.setdefault(group_of(name)[0], Group(*group_of(name)))
        values = list(series[name][1])
        if is_constant(values):
            group.constants.append((name, f"{values[-1]:.4g}"))
        else:
            group.charts.append(name)
    return ChartLayout(
        headline, key, [groups[g] for g in sorted(groups, key=_group_order)], columns
    )


def client_config() -> dict:
    """The layout rules for run_live.js, so metrics first seen live land in the same place."""
    return {
        "headline": HEADLINE,
        "evalPrefix": EVAL_PREFIX,
        "key": list(KEY_METRICS),
        "notPlotted": list(NOT_PLOTTED),
        "groups": [{"id": i, "title": t} for i, t in GROUPS.items()],
        "other": {"id": OTHER_GROUP[0], "title": OTHER_GROUP[1]},
        "rolesPrefix": ROLES_PREFIX,
        "roleFirst": ROLE_FIRST,
        "etaWindow": ETA_WINDOW,
        "etaHorizon": ETA_HORIZON_S,
        "unboundedSteps": UNBOUNDED_STEPS,
    }


def series(points) -> dict:
    """Metric points ``(step, name, value, created_at)`` in step order, as compact columns.

    ``{"series": {name: [[steps], [values]]}, "stepTimes": [[step, unix seconds], ...]}``;
    a step's time is when its first point was stored.
    """
    columns: dict[str, tuple[list[int], list[float]]] = {}
    times: dict[int, float] = {}
    for step, name, value, created_at in points:
        steps, values = columns.setdefault(name, ([], []))
        steps.append(step)
        values.append(float(f"{value:.6g}"))
        t = round(created_at.timestamp(), 3)
        times[step] = min(times.get(step, t), t)
    return {
        "series": {name: [s, v] for name, (s, v) in sorted(columns.items())},
        "stepTimes": sorted(times.items()),
    }


def latest_values(points) -> list[dict]:
    """Each metric's last point ``(step, name, value)`` as ``{"name", "step", "value"}``."""
    return [{"name": name, "step": step, "value": value} for step, name, value in points]


def chart_stride(last_step: int) -> int:
    """Steps averaged into one chart point, so a page holds at most ``CHART_MAX_POINTS`` per metric."""
    return max(1, math.ceil(last_step / CHART_MAX_POINTS))


@dataclass
class Pace:
    steps_per_min: float
    trajectories_per_min: float | None  # None when the run reports no rollout/num_trajectories


@dataclass
class Progress:
    step: int
    max_steps: int | None  # None when there is no end in reach (UNBOUNDED_STEPS): no bar
    percent: float | None  # 0-100, None without a bounded max_steps
    eta_s: float | None  # a dataset run's time to max_steps, while it runs at a measured pace
    pace: Pace | None  # instead of the ETA: an online run's, or one whose end is out of reach
    running_s: float | None  # since the run started, while it runs


def progress(
    *,
    step: int,
    max_steps: int | None,
    status: str,
    step_times,
    mode: str = "dataset",
    trajectories: Sequence[float] = (),
    started_at: datetime | None = None,
    now: datetime | None = None,
) -> Progress:
    """How far the run is and, while it runs, when it should finish or how fast it goes.

    pace = the median of the last ``ETA_WINDOW`` intervals between consecutive steps
    (``step_times`` as ``[(step, unix seconds), ...]``); ETA = steps left × pace. An online
    run trains on whatever its agents send, so it has no forecast: it shows steps/min,
    trajectories/min (steps/min × the mean of ``trajectories``, the recent steps'
    ``rollout/num_trajectories``) and how long it has run; so does a run whose max_steps is out
    of reach (``UNBOUNDED_STEPS``, or an ETA beyond ``ETA_HORIZON_S``). run_live.js computes
    the same from the live points.
    """
    end = max_steps if max_steps and max_steps < UNBOUNDED_STEPS else None
    percent = round(min(100.0, 100.0 * step / end), 1) if end else None
    recent = sorted(step_times)[-(ETA_WINDOW + 1) :]
    paces = [
        (t1 - t0) / (s1 - s0)
        for (s0, t0), (s1, t1) in zip(recent, recent[1:], strict=False)
        if s1 > s0
    ]
    step_s = statistics.median(paces) if paces else None
    running = status == "running"
    eta = pace = None
    if running and step_s and end and step < end:
        eta = (end - step) * step_s
    if running and step_s and (mode == "online" or not end or (eta or 0) > ETA_HORIZON_S):
        per_min = 60.0 / step_s
        per_step = statistics.fmean(trajectories) if trajectories else None
        pace, eta = Pace(per_min, per_min * per_step if per_step is not None else None), None
    running_s = None
    if running and started_at is not None:
        running_s = max(0.0, ((now or datetime.now(UTC)) - started_at).total_seconds())
    return Progress(step, end, percent, eta, pace, running_s)
