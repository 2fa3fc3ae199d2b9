"""The Celery worker's metrics: its tasks, by name and outcome, on ``WORKER_METRICS_PORT``.

No tasks here: Celery imports every app's ``tasks`` module when a worker starts, which
connects these signal handlers. With ``WORKER_METRICS_PORT`` set (0, the default: off), the
worker's main process serves ``GET /metrics`` on that port, on every interface, to callers
from ``INTERNAL_API_ALLOWED_CIDRS`` only (403 otherwise, as ``/internal/``). The tasks run in
the pool's processes (prefork children), so their counts go through a multiprocess directory
of the worker's own (``webapp.metrics.multiprocess``), which the main process reads.

What the worker does to runs, sessions and evaluations is in the database, and the web's
``/metrics`` exports it; this adds only what the worker alone knows: how its tasks went.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, make_server

from celery.signals import task_postrun, task_prerun, worker_init
from django.conf import settings
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.multiprocess import MultiProcessCollector

from webapp.metrics import multiprocess

logger = logging.getLogger(__name__)

TASKS = Counter(
    "steep_worker_tasks",
    "Celery tasks the worker finished, by task name and final state (SUCCESS, FAILURE, RETRY).",
    ["task", "state"],
    registry=None,
)
TASK_DURATION = Histogram(
    "steep_worker_task_duration_seconds",
    "How long the worker's tasks ran, by task name.",
    ["task"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800),
    registry=None,
)

_serving = False  # set in the main process before the pool forks: its children count too
_started: dict[str, float] = {}  # task id → when it started, in the process running it


@worker_init.connect
def _serve_metrics(**_) -> None:
    global _serving
    port = settings.WORKER_METRICS_PORT
    if not port:
        return
    directory = multiprocess.configure(
        data_dir=settings.DATA_DIR, role="worker", owner_pid=os.getpid()
    )
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    try:
        server = make_server(
            "", port, guarded(make_wsgi_app(registry)), ThreadingWSGIServer, _QuietHandler
        )
    except OSError as exc:  # the worker runs on; its metrics do not
        logger.error("worker metrics: cannot listen on WORKER_METRICS_PORT=%d: %s", port, exc)
        return
    threading.Thread(target=server.serve_forever, name="steep-metrics", daemon=True).start()
    _serving = True
    logger.info("worker metrics on port %d (/metrics)", port)


@task_prerun.connect
def _task_started(task_id=None, **_) -> None:
    if _serving:
        _started[task_id] = time.perf_counter()


@task_postrun.connect
def _task_finished(task_id=None, task=None, state=None, **_) -> None:
    if not _serving:
        return
    started = _started.pop(task_id, None)
    TASKS.labels(task.name, state or "UNKNOWN").inc()
    if started is not None:
        TASK_DURATION.labels(task.name).observe(time.perf_counter() - started)


def guarded(app):
    """``app`` at ``/metrics`` for callers from ``INTERNAL_API_ALLOWED_CIDRS``; 403 for others,
    404 elsewhere, in the internal API's error shape."""
    from webapp.runs.internal import network_allowed

    def guarded_app(environ, start_response):
        if not network_allowed(environ.get("REMOTE_ADDR", "")):
            return _error(start_response, "403 Forbidden", "not reachable from this network")
        if environ.get("PATH_INFO") != "/metrics":
            return _error(start_response, "404 Not Found", "the worker serves /metrics only")
        return app(environ, start_response)

    return guarded_app


def _error(start_response, status: str, message: str) -> list[bytes]:
    body = {"error": {"message": message, "code": "internal_api_error", "fields": {}}}
    start_response(status, [("Content-Type", "application/json")])
    return [json.dumps(body).encode()]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass
