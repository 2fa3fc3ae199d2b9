"""Gauges read at scrape time: the runs, sessions and trajectories in the database, and what
the inference servers say about their queues.

Nothing here is tracked per request: each scrape counts what is stored (a handful of grouped
queries over indexed columns, bounded by the active runs) and asks each inference server
for its ``/get_server_info`` (at most ``SERVER_TIMEOUT_S`` each, all at once). Per-run
series cover the active runs (queued, starting, running, stopping); a finished run's
series end with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
from django.db import DatabaseError
from django.db.models import Count, OuterRef, Subquery
from prometheus_client.core import GaugeMetricFamily, Metric

from webapp.gateway.models import InferenceServer, Session
from webapp.pools.models import PoolServer
from webapp.runs.models import MetricPoint, Run

logger = logging.getLogger(__name__)

ACTIVE = (Run.Status.QUEUED, Run.Status.STARTING, Run.Status.RUNNING, Run.Status.STOPPING)
SERVER_TIMEOUT_S = 1.0

# The latest reported value of these step metrics (rl_core.loop, rl_core.trainer), per run.
LATEST = {
    "timing/step": ("steep_run_step_seconds", "Wall time of the run's latest training step."),
    "staleness/mean": (
        "steep_run_staleness_mean",
        "Policy versions the latest step's trajectories' oldest tokens lagged its weights, mean.",
    ),
    "staleness/max": (
        "steep_run_staleness_max",
        "Policy versions the latest step's trajectories' oldest tokens lagged its weights, most.",
    ),
}


class StateCollector:
    """A prometheus_client collector of the gauges above, read at each ``collect``."""

    def describe(self) -> list[Metric]:
        return []  # nothing to read at registration

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(_read())
        except DatabaseError as exc:  # the counters are still worth a scrape
            logger.warning("metrics: could not read the database: %r", exc)
            families = []
        yield GaugeMetricFamily(
            "steep_database_up",
            "1 when this scrape read the database, 0 when it could not (then no state gauges).",
            value=int(bool(families)),
        )
        yield from families


def _read() -> Iterator[Metric]:
    runs = list(
        Run.objects.filter(status__in=ACTIVE)
        .order_by("created_at")
        .values_list("id", "name", "project__name", "mode", "step", "weight_version")
    )
    ids = [str(run[0]) for run in runs]
    yield _runs_by_status()
    yield from _run_gauges(runs)
    yield from _session_gauges(ids)
    yield from _server_gauges(ids)


def _runs_by_status() -> Metric:
    family = GaugeMetricFamily("steep_runs", "Runs in each status.", labels=["status"])
    counts = dict(Run.objects.order_by().values_list("status").annotate(n=Count("pk")))
    for status in Run.Status.values:
        family.add_metric([status], counts.get(status, 0))
    return family


def _run_gauges(runs: list[tuple]) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "steep_run_info",
        "1 per active run, naming it: its name, project and mode.",
        labels=["run", "name", "project", "mode"],
    )
    step = GaugeMetricFamily("steep_run_step", "The run's latest training step.", labels=["run"])
    version = GaugeMetricFamily(
        "steep_run_weight_version",
        "The policy version the run's inference servers serve.",
        labels=["run"],
    )
    for run_id, name, project, mode, run_step, weight_version in runs:
        info.add_metric([str(run_id), name, project, mode], 1)
        step.add_metric([str(run_id)], run_step)
        version.add_metric([str(run_id)], weight_version)
    yield from (info, step, version)

    latest_step = MetricPoint.objects.filter(
        run_id=OuterRef("run_id"), name=OuterRef("name")
    ).order_by("-step")
    points = MetricPoint.objects.filter(
        run_id__in=[run[0] for run in runs],
        name__in=LATEST,
        step=Subquery(latest_step.values("step")[:1]),
    ).values_list("run_id", "name", "value")
    families = {
        name: GaugeMetricFamily(metric, help_text, labels=["run"])
        for name, (metric, help_text) in LATEST.items()
    }
    for run_id, name, value in points:
        families[name].add_metric([str(run_id)], value)
    yield from families.values()


def _session_gauges(ids: list[str]) -> Iterator[Metric]:
    """Open sessions of every run (0 for an active run with none); trajectories of the active
    runs by state (``Session.Trajectory``)."""
    open_ = GaugeMetricFamily(
        "steep_sessions_open",
        "Agent sessions (episodes) open now, per run.",
        labels=["run"],
    )
    counts = {str(run): 0 for run in ids}
    opened = Session.objects.filter(status=Session.Status.OPEN).order_by().values_list("run_id")
    for run_id, n in opened.annotate(n=Count("pk")):
        counts[str(run_id or "")] = n
    for run_id, n in counts.items():
        open_.add_metric([run_id], n)
    yield open_

    trajectories = GaugeMetricFamily(
        "steep_trajectories",
        "The active runs' sessions by trajectory state (pending while open; ready, claimed, "
        "trained, dropped, unrewarded).",
        labels=["run", "state"],
    )
    by_state = {(run, state): 0 for run in ids for state in Session.Trajectory.values}
    stored = (
        Session.objects.filter(run_id__in=ids)
        .order_by()
        .values_list("run_id", "trajectory")
        .annotate(n=Count("pk"))
    )
    for run_id, state, n in stored:
        by_state[str(run_id), state] = n
    for (run_id, state), n in by_state.items():
        trajectories.add_metric([run_id, state], n)
    yield trajectories


def _server_gauges(ids: list[str]) -> Iterator[Metric]:
    healthy = GaugeMetricFamily(
        "steep_inference_server_healthy",
        "1 while the gateway sends an active run's requests to the server, 0 while it backs off.",
        labels=["run", "server", "backend"],
    )
    urls: set[str] = set()
    servers = InferenceServer.objects.filter(run_id__in=ids).values_list(
        "run_id", "url", "backend", "healthy"
    )
    for run_id, url, backend, up in servers:
        healthy.add_metric([str(run_id), url, backend], int(up))
        urls.add(url)
    yield healthy
    urls.update(PoolServer.objects.values_list("url", flat=True))

    reporting = GaugeMetricFamily(
        "steep_inference_server_reporting",
        "1 when the server answered GET /get_server_info at this scrape, else 0.",
        labels=["server"],
    )
    figures = {
        "queue_depth": GaugeMetricFamily(
            "steep_inference_server_queue_depth",
            "Requests waiting in the server's queue (num_waiting_reqs).",
            labels=["server"],
        ),
        "running": GaugeMetricFamily(
            "steep_inference_server_running_requests",
            "Requests the server is generating now (num_running_reqs).",
            labels=["server"],
        ),
        "tokens_per_s": GaugeMetricFamily(
            "steep_inference_server_tokens_per_second",
            "Tokens the server generated per second (the torch engine: over its last 10 s).",
            labels=["server"],
        ),
    }
    ordered = sorted(urls)
    for url, state in zip(ordered, _server_states(ordered), strict=True):
        reporting.add_metric([url], int(state is not None))
        for name, value in (state or {}).items():
            figures[name].add_metric([url], value)
    yield reporting
    yield from figures.values()


def _server_states(urls: list[str]) -> list[dict[str, float] | None]:
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return list(pool.map(_server_state, urls))


def _server_state(url: str) -> dict[str, float] | None:
    """The queue figures a server's ``/get_server_info`` reports (the torch engine's, and
    SGLang's where it has them), or None when it does not answer."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/get_server_info", timeout=SERVER_TIMEOUT_S)
        response.raise_for_status()
        states = response.json().get("internal_states") or [{}]
        state = states[0] if isinstance(states[0], dict) else {}
    except (httpx.HTTPError, ValueError, AttributeError, TypeError, LookupError):
        return None
    figures = {}
    if _number(state.get("num_waiting_reqs")):
        figures["queue_depth"] = float(state["num_waiting_reqs"])
    if _number(state.get("num_running_reqs")):
        figures["running"] = float(state["num_running_reqs"])
    tenants = state.get("tenants")
    if isinstance(tenants, dict):  # the torch engine: per run
        rates = [t.get("tokens_per_s") for t in tenants.values() if isinstance(t, dict)]
        figures["tokens_per_s"] = float(sum(rate for rate in rates if _number(rate)))
    elif _number(state.get("last_gen_throughput")):  # SGLang's scheduler
        figures["tokens_per_s"] = float(state["last_gen_throughput"])
    return figures


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
