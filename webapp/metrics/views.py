"""``GET /metrics``: the web process's metrics in Prometheus's text format.

Answered by a middleware placed where the health probes are, before host validation and the
HTTPS redirect: Prometheus scrapes each web process at its own address (a pod IP) over plain
HTTP. It answers only callers from ``INTERNAL_API_ALLOWED_CIDRS`` (empty: any network), as
``/internal/`` does, and the same 403 otherwise.

One exposition holds this server's counters (``webapp.metrics.instruments``: this process's,
or every worker's when several run) and the gauges read now (``webapp.metrics.state``). The
reads run in a thread of their own, not the one Django's sync views share: a slow inference
server must not hold up the dashboard.
"""

from __future__ import annotations

from functools import cache

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.utils.decorators import sync_and_async_middleware
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from webapp.metrics import instruments
from webapp.metrics.state import StateCollector

PATH = "/metrics"


@cache
def registry() -> CollectorRegistry:
    """What a scrape reads: the gateway's counters (from the shared files when several
    workers count) and the state gauges."""
    registry = CollectorRegistry()
    if instruments.MULTIPROCESS_DIR is not None:
        MultiProcessCollector(registry, path=str(instruments.MULTIPROCESS_DIR))
    else:
        for metric in instruments.METRICS:
            registry.register(metric)
        ProcessCollector(registry=registry)  # this process's CPU and memory
    registry.register(StateCollector())
    return registry


def metrics(request: HttpRequest) -> HttpResponse:
    from webapp.runs.internal import _error, _network_allowed

    if not _network_allowed(request):
        return _error(403, "/metrics is not reachable from this network")
    if request.method not in ("GET", "HEAD"):
        return _error(405, "use GET")
    try:
        body = generate_latest(registry())
    finally:
        if not connection.in_atomic_block:  # a scrape holds no connection between scrapes
            connection.close()
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)


@sync_and_async_middleware
def metrics_middleware(get_response):
    if iscoroutinefunction(get_response):

        async def middleware(request):
            if request.path_info == PATH:
                return await sync_to_async(metrics, thread_sensitive=False)(request)
            return await get_response(request)

    else:

        def middleware(request):
            if request.path_info == PATH:
                return metrics(request)
            return get_response(request)

    return middleware
