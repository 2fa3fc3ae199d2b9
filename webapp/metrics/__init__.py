"""Prometheus metrics of the web and worker processes (docs/metrics.md lists them).

- ``instruments``: the web process's counters, recorded per gateway request (requests and
  latency by endpoint and status, 429s by reason).
- ``state``: gauges read from the database and the inference servers at each scrape (runs,
  open sessions, trajectories by state, per-run step time, version and staleness, queue
  depth and tokens/s per server).
- ``views``: ``GET /metrics`` on the web server, for ``INTERNAL_API_ALLOWED_CIDRS`` only.
- ``tasks``: the Celery worker's task counters, on ``WORKER_METRICS_PORT``.
- ``multiprocess``: one set of counters for several uvicorn workers (or a worker's pool).
"""
