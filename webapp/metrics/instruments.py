"""The web process's own counters: the gateway's requests, their latency and its 429s.

Recorded once per agent request, after its answer is sent, by whichever route served it
(``webapp.gateway.asgi``'s fast route; ``webapp.gateway.views``, which under ASGI serves only
``GET /models`` and counts until its response starts): a counter increment and
a histogram observation, plus one more increment for a 429. No lock is held across an await
and nothing touches the database. Under several uvicorn workers the values go to this
worker's files of the shared multiprocess directory (``webapp.metrics.multiprocess``).
"""

from __future__ import annotations

import time

from django.conf import settings
from prometheus_client import Counter, Histogram, disable_created_metrics

from webapp.metrics import multiprocess

# Before any metric has a value: where this worker's values go when several run.
MULTIPROCESS_DIR = multiprocess.configure(
    data_dir=settings.DATA_DIR, role="web", owner_pid=multiprocess.web_owner()
)
# No `_created` series beside each counter: the same exposition with one process or several.
disable_created_metrics()

# From a quick RL protocol call to a long streamed generation.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

GATEWAY_REQUESTS = Counter(
    "steep_gateway_requests",
    "Agent requests the gateway answered, by endpoint and HTTP status.",
    ["endpoint", "status"],
    registry=None,
)
GATEWAY_LATENCY = Histogram(
    "steep_gateway_request_duration_seconds",
    "Time from a gateway request's arrival to the last byte of its answer (a stream's end).",
    ["endpoint", "status"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
GATEWAY_REFUSALS = Counter(
    "steep_gateway_refusals",
    "Gateway requests refused with 429, by endpoint and reason (the error's code: "
    "staleness_budget_full, pool_sessions_per_run, pool_requests_per_run, rate_limit_exceeded).",
    ["endpoint", "reason"],
    registry=None,
)

METRICS = (GATEWAY_REQUESTS, GATEWAY_LATENCY, GATEWAY_REFUSALS)


def gateway_request(endpoint: str, status: int, reason: str, started: float) -> None:
    """Count one answered gateway request that arrived at ``started`` (``time.perf_counter``).
    ``reason``: the error's code, counted as the refusal's reason when ``status`` is 429."""
    code = str(status)
    GATEWAY_REQUESTS.labels(endpoint, code).inc()
    GATEWAY_LATENCY.labels(endpoint, code).observe(time.perf_counter() - started)
    if status == 429:
        GATEWAY_REFUSALS.labels(endpoint, reason or "unknown").inc()
