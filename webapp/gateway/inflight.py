"""Completions still generating, so that a retry of one gets its answer instead of a second turn.

An SDK whose request timed out sends it again (the openai SDK marks the retry with
``X-Stainless-Retry-Count``; any client may send an ``Idempotency-Key`` header, which names the
request across its attempts). Once the first attempt is recorded, the database answers the
retry (``turns.begin``: the session's last turn, or a project key's one-turn completion within
``turns.REPLAY_WINDOW``). While it is still generating, the retry waits here for its answer:
one generation, one turn recorded, the same response to both callers.

Only a retry waits: the same body sent twice without a retry mark or an ``Idempotency-Key`` is
two samples (an agent sampling one prompt several times). A request is known by the caller's
key hash, the agent and its request key (the ``Idempotency-Key``, else the body's
fingerprint), so only the caller holding the same key gets the answer.

In one web process this is a dict (``IN_FLIGHT``): no database statement, no round trip.
Several web processes (``WEB_WORKERS`` in the compose deployment) share Redis
(``REDIS_URL``): an attempt that may be retried (it carries ``X-Stainless-Retry-Count``, which
the SDKs send from the first attempt on, or an ``Idempotency-Key``) holds a marker there while
it generates (``SHARED.hold``), and a retry that finds no attempt in its own process waits
until no marker is left (``SHARED.settled``), then reads the recorded answer from the
database as after any finished attempt. A marker lives ``MARK_TTL_S`` and its holder renews
it while it generates, so a process that dies leaves a retry waiting at most that long.
Without Redis, or while it does not answer, a retry on another process is a new sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

from django.conf import settings

from rl_core.ids import new_hex
from webapp import shared_redis

logger = logging.getLogger(__name__)

Key = tuple[str, str, str]  # (agent id, key hash, request key)


def request_key(fingerprint: str, idempotency_key: str) -> str:
    """What identifies a request across its attempts: its ``Idempotency-Key`` when sent, else
    its body's fingerprint. Recorded as the turn's ``request_hash``."""
    if not idempotency_key:
        return fingerprint
    return hashlib.sha256(f"idempotency-key\x00{idempotency_key}".encode()).hexdigest()


class InFlight:
    """The answers being generated, by ``Key``; one event loop (a web process's)."""

    def __init__(self) -> None:
        self._pending: dict[Key, asyncio.Future[dict]] = {}

    async def answer(self, key: Key) -> dict | None:
        """The response of the attempt with ``key`` still generating, once recorded; None when
        there is none or it failed (the retry then generates its own)."""
        future = self._pending.get(key)
        if future is None:
            return None
        try:
            return await asyncio.shield(future)
        except Exception:
            return None

    @contextlib.contextmanager
    def track(self, key: Key) -> Iterator[asyncio.Future[dict]]:
        """Register an attempt while it generates; set the future's result to its recorded
        response. Left unset (an error, a cancellation), waiters generate their own."""
        future: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            yield future
        finally:
            if self._pending.get(key) is future:
                del self._pending[key]
            if not future.done():
                future.set_exception(RuntimeError("the first attempt did not finish"))
                future.exception()  # retrieved: no "never retrieved" warning when nobody waits


IN_FLIGHT = InFlight()


# --- across web processes (Redis) -------------------------------------------------------------

MARK_TTL_S = 10.0  # how long a marker outlives a holder that stopped renewing it (one that died)
RENEW_S = 3.0  # how often a holder renews its marker while it generates
POLL_S = 0.05  # how often a waiting retry looks again
BACK_OFF_S = 5.0  # after a Redis failure, this process goes without it this long
_PREFIX = "steep:inflight:"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end"


class SharedInFlight:
    """Markers in Redis for the attempts generating in any web process (``REDIS_URL``)."""

    def __init__(self) -> None:
        self._warned_at = 0.0
        self._failed_at = -BACK_OFF_S  # the last Redis failure: skipped for BACK_OFF_S after it

    @contextlib.asynccontextmanager
    async def hold(self, key: Key, *, retriable: bool) -> AsyncIterator[None]:
        """Mark ``key`` as generating in this process until the block ends; nothing when the
        attempt cannot be retried (no retry mark, no ``Idempotency-Key``) or Redis is off."""
        client = self._client() if retriable else None
        if client is None:
            yield
            return
        name, token = _name(key), new_hex()
        if not self._call(client.set, name, token, px=_ms(MARK_TTL_S)):
            yield
            return
        renewing = asyncio.create_task(self._renew(client, name))
        try:
            yield
        finally:
            renewing.cancel()
            self._call(client.eval, _RELEASE, 1, name, token)

    async def settled(self, key: Key) -> None:
        """Return once no web process holds ``key`` (at once without Redis, or when it fails)."""
        client = self._client()
        if client is None:
            return
        name = _name(key)
        while self._call(client.exists, name):
            await asyncio.sleep(POLL_S)

    async def _renew(self, client, name: str) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            self._call(client.pexpire, name, _ms(MARK_TTL_S))

    def _client(self):
        """Redis, unless it is not configured or failed in the last ``BACK_OFF_S`` (each call
        blocks the event loop until it answers or times out: a Redis that hangs must not slow
        every request down)."""
        if not settings.REDIS_URL or time.monotonic() - self._failed_at < BACK_OFF_S:
            return None
        return shared_redis.client(settings.REDIS_URL)

    def _call(self, method, *args, **kwargs):
        """``method(...)``'s answer; None when Redis fails (said in the log once a minute)."""
        try:
            return method(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (any Redis failure: carry on without it)
            self._failed_at = time.monotonic()
            if time.monotonic() - self._warned_at > 60:
                self._warned_at = time.monotonic()
                logger.warning("retries are deduplicated per web process: Redis failed (%s)", exc)
            return None


def _name(key: Key) -> str:
    return _PREFIX + hashlib.sha256("\x00".join(key).encode()).hexdigest()


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


SHARED = SharedInFlight()


async def earlier_answer(key: Key) -> dict | None:
    """For a retry: the answer of its attempt still generating in this process, once recorded;
    else None, once no other web process is generating it either (the database then holds
    its recorded answer, if any: ``turns.begin`` replays it)."""
    answer = await IN_FLIGHT.answer(key)
    if answer is None:
        await SHARED.settled(key)
    return answer


@contextlib.asynccontextmanager
async def generating(key: Key, *, retriable: bool) -> AsyncIterator[asyncio.Future[dict]]:
    """Mark an attempt as generating, here (``IN_FLIGHT``) and, when ``retriable``, for the
    other web processes (``SHARED``); set the future's result to its recorded response."""
    with IN_FLIGHT.track(key) as answered:
        async with SHARED.hold(key, retriable=retriable):
            yield answered
