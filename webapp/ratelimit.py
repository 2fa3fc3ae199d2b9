"""Per-key request counters for the REST API and the gateway.

A fixed window of 60 s per bucket, opened by the bucket's first request. With
``REDIS_URL`` the counters live in Redis and are shared by every web worker: one
round trip per request (``INCR`` + ``TTL`` in a pipeline; ``EXPIRE`` only when a
window opens). Without it they are kept in this process, so with several web
workers each enforces the limit on its own. A Redis outage lets requests through
(and says so in the log): the limits protect the service, they must not take it down.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from django.conf import settings

from webapp.shared_redis import client as _client

logger = logging.getLogger(__name__)

WINDOW_S = 60
_PREFIX = "steep:rl:"


@dataclass(frozen=True)
class Limited:
    """A request over the limit: refuse it and tell the client when to come back."""

    limit: int
    retry_after: int  # seconds until the bucket's window closes (at least 1)


def hit(bucket: str, *, limit: int) -> Limited | None:
    """Count one request against ``bucket``; ``Limited`` when it is over ``limit`` per minute.

    ``limit`` 0 (or less) turns limiting off and costs nothing.
    """
    if limit <= 0:
        return None
    if settings.REDIS_URL:
        count, ttl = _redis_hit(bucket)
    else:
        count, ttl = _local_hit(bucket)
    if count <= limit:
        return None
    return Limited(limit=limit, retry_after=max(1, math.ceil(ttl)))


def tally(bucket: str) -> None:
    """Count one event in ``bucket``'s window, with no limit (``peek`` reads it back)."""
    (_redis_hit if settings.REDIS_URL else _local_hit)(bucket)


def peek(bucket: str) -> int:
    """Events counted in ``bucket``'s open window (0 when none is open, or Redis is down)."""
    if not settings.REDIS_URL:
        with _lock:
            count, ends = _windows.get(bucket, (0, 0.0))
        return count if ends > time.monotonic() else 0
    try:
        return int(_client(settings.REDIS_URL).get(_PREFIX + bucket) or 0)
    except Exception:  # noqa: BLE001 (a dashboard figure: missing, not an error page)
        return 0


# --- Redis ----------------------------------------------------------------------------------


_last_warning = 0.0


def _redis_hit(bucket: str) -> tuple[int, float]:
    global _last_warning
    key = _PREFIX + bucket
    client = _client(settings.REDIS_URL)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.incr(key)
        pipe.ttl(key)
        count, ttl = pipe.execute()
        if ttl < 0:  # a new window (or one whose EXPIRE was lost): start its clock
            client.expire(key, WINDOW_S)
            ttl = WINDOW_S
    except Exception as exc:  # noqa: BLE001 (any Redis failure: let the request through)
        now = time.monotonic()
        if now - _last_warning > WINDOW_S:
            _last_warning = now
            logger.warning("rate limiting is off: Redis did not answer (%s)", exc)
        return 0, 0.0
    return int(count), float(ttl)


# --- this process ---------------------------------------------------------------------------

_lock = threading.Lock()
_windows: dict[str, tuple[int, float]] = {}  # bucket -> (count, monotonic end of window)


def _local_hit(bucket: str) -> tuple[int, float]:
    now = time.monotonic()
    with _lock:
        count, ends = _windows.get(bucket, (0, 0.0))
        if ends <= now:
            count, ends = 0, now + WINDOW_S
            if len(_windows) > 10_000:  # forget closed windows now and then
                for name in [name for name, (_, end) in _windows.items() if end <= now]:
                    del _windows[name]
        _windows[bucket] = (count + 1, ends)
    return count + 1, ends - now
