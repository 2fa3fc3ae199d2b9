"""The web process's Redis client (``REDIS_URL``), for what its worker processes share: the
rate-limit counters (``webapp.ratelimit``) and the markers of completions still generating
(``webapp.gateway.inflight``). Short timeouts: a Redis that does not answer within half a
second is treated as down by its callers, who carry on without it."""

from __future__ import annotations

from functools import lru_cache

TIMEOUT_S = 0.5


@lru_cache(maxsize=4)
def client(url: str):
    """One client (and its connection pool) per URL, per process."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
