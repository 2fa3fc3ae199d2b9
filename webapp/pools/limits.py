"""A pool's per-run request limit, enforced where the gateway calls the servers.

``Pool.max_requests_per_run`` bounds the generation requests one attached run has in
flight in the pool, so that one busy run cannot fill every server's batch. The gateway
takes ``n`` (the request's samples) before it calls a server and gives them back when
the answer (or the stream) is done; over the limit it answers 429 with ``Retry-After``
and a message naming the limit.

Counted per web process, like the gateway's other load figures (``CACHES.in_flight``):
with W web processes a run may have up to W x the limit in flight. The limit itself is
re-read from the database at most every ``LIMIT_TTL_S`` per pool.
"""

from __future__ import annotations

import time
from collections import Counter

from asgiref.sync import sync_to_async

from webapp.gateway.errors import GatewayError

LIMIT_TTL_S = 5.0
RETRY_AFTER_S = 1

_limits: dict[str, tuple[float, int]] = {}  # pool name → (expiry, max_requests_per_run)
in_flight: Counter = Counter()  # run id → requests in flight in its pool, this process


def _read_limit(name: str) -> int:
    from webapp.pools.models import Pool

    value = Pool.objects.filter(name=name).values_list("max_requests_per_run", flat=True).first()
    return int(value or 0)


async def request_limit(pool: str) -> int:
    cached = _limits.get(pool)
    if cached is not None and cached[0] > time.monotonic():
        return cached[1]
    limit = await sync_to_async(_read_limit, thread_sensitive=False)(pool)
    _limits[pool] = (time.monotonic() + LIMIT_TTL_S, limit)
    return limit


async def take(run_id, pool: str, n: int) -> int:
    """Count ``n`` requests of ``run_id`` in ``pool``; returns what ``give_back`` must return
    (0 for a run on no pool, or a pool with no limit). Over the limit: a 429."""
    if not pool:
        return 0
    limit = await request_limit(pool)
    if not limit:
        return 0
    if in_flight[run_id] + n > limit:
        raise GatewayError(
            429,
            f"This run has {in_flight[run_id]} requests in flight in inference pool '{pool}', "
            f"whose max_requests_per_run is {limit}; retry when one has finished.",
            code="pool_requests_per_run",
            retry_after=RETRY_AFTER_S,
        )
    in_flight[run_id] += n
    return n


def give_back(run_id, n: int) -> None:
    if n:
        in_flight[run_id] -= n
        if in_flight[run_id] <= 0:
            del in_flight[run_id]


def clear() -> None:
    _limits.clear()
    in_flight.clear()
