"""The run page's charts and progress line: which metric goes in which panel, the data the
page starts from, and the ETA. Pure functions over the run's metric points; static/run_live.js
draws the charts and keeps them live with the same panel rules (sent to it as JSON)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

HEADLINE = "rollout/reward"  # drawn large at the top, beside any eval/ metrics
EVAL_PREFIX = "eval/"
# (panel id, title, metric-name prefixes), in page order; anything else goes to "Other".
PANELS: list[tuple[str, str, tuple[str, ...]]] = [
    ("reward", "Reward", ("rollout/",)),
    ("policy", "Policy / PPO", ("ppo/", "loss/")),
    # The engines' logprobs against the trainer's recomputation (rl_core.correction).
    ("correction", "Rollout correction", ("correction/",)),
    # On-policy distillation's teacher (rl_core.distill): its calls, latency, reverse KL.
    ("distill", "Distillation", ("distill/", "timing/teacher")),
    ("staleness", "Staleness", ("staleness/",)),
    # Before "system", which takes every other timing/: what each weight update moved and
    # how long it held inference up (rl_core.weight_sync, rl_core.adapter_sync).
    (
        "sync",
        "Weight sync",
        ("weight_sync/", "timing/weight_", "timing/inference_stall", "timing/save_weights"),
    ),
    ("system", "Throughput / System", ("perf/", "timing/", "sessions/", "system/")),
]
OTHER = ("other", "Other")
# Chart points per metric a run page starts with: above this many steps, each point is the
# mean of a bucket of steps (webapp.runs.selectors.metric_points); live points come per step.
CHART_MAX_POINTS = 1000
ETA_WINDOW = 10  # step intervals the ETA averages over (their median: a pause does not skew it)


@dataclass
class Panel:
    id: str
    title: str
    metrics: list[str] = field(default_factory=list)


@dataclass
class ChartLayout:
    headline: list[str]  # rollout/reward, then eval/ metrics; empty before the first step
    panels: list[Panel]  # only panels that have metrics


def panel_of(name: str) -> tuple[str, str]:
    for panel_id, title, prefixes in PANELS:
        if name.startswith(prefixes):
            return panel_id, title
    return OTHER


def chart_layout(names: Iterable[str]) -> ChartLayout:
    names = sorted(set(names))
    headline = [HEADLINE] if HEADLINE in names else []
    headline += [n for n in names if n.startswith(EVAL_PREFIX)]
    panels: dict[str, Panel] = {}
    for panel_id, title in [(p[0], p[1]) for p in PANELS] + [OTHER]:
        panels[panel_id] = Panel(panel_id, title)
    for name in names:
        if name not in headline:
            panels[panel_of(name)[0]].metrics.append(name)
    return ChartLayout(headline, [p for p in panels.values() if p.metrics])


def client_config() -> dict:
    """The panel rules for run_live.js, so charts of metrics first seen live land in the same place."""
    return {
        "headline": HEADLINE,
        "evalPrefix": EVAL_PREFIX,
        "panels": [{"id": i, "title": t, "prefixes": list(p)} for i, t, p in PANELS],
        "other": {"id": OTHER[0], "title": OTHER[1]},
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
class Progress:
    step: int
    max_steps: int | None
    percent: float | None  # 0-100, None without max_steps
    eta_s: float | None  # None unless running with a measured pace


def progress(*, step: int, max_steps: int | None, status: str, step_times) -> Progress:
    """How far the run is and, while it runs, when it should finish.

    ETA = steps left × the median of the last ``ETA_WINDOW`` intervals between consecutive
    steps (``step_times`` as ``[(step, unix seconds), ...]``); run_live.js computes the same
    from the live points.
    """
    percent = None
    if max_steps:
        percent = round(min(100.0, 100.0 * step / max_steps), 1)
    eta = None
    recent = sorted(step_times)[-(ETA_WINDOW + 1) :]
    paces = [
        (t1 - t0) / (s1 - s0)
        for (s0, t0), (s1, t1) in zip(recent, recent[1:], strict=False)
        if s1 > s0
    ]
    if status == "running" and max_steps and paces and step < max_steps:
        eta = (max_steps - step) * statistics.median(paces)
    return Progress(step, max_steps, percent, eta)
