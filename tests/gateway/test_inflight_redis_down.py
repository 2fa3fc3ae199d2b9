"""A Redis that fails (down, or not answering) leaves retries deduplicated per web process only:
an attempt generates, a retry does not wait, and this process stops asking Redis for a while
instead of paying a timeout on every request."""

from __future__ import annotations

import asyncio

import pytest
import redis

from webapp import shared_redis
from webapp.gateway.inflight import BACK_OFF_S, SharedInFlight, _name

KEY = ("agent", "key-hash", "request")


def test_a_redis_that_does_not_answer_is_skipped_for_a_while(settings, monkeypatch):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    calls = []
    real = shared_redis.client

    def counted(url):
        calls.append(url)
        return real(url)

    monkeypatch.setattr(shared_redis, "client", counted)
    shared = SharedInFlight()

    async def attempt_then_retry():
        async with shared.hold(KEY, retriable=True):  # the marker cannot be set: it generates
            pass
        await asyncio.wait_for(shared.settled(KEY), 5)  # and a retry does not wait

    asyncio.run(attempt_then_retry())
    assert len(calls) == 1, "after the first failure Redis is not asked again"
    shared._failed_at -= BACK_OFF_S  # later: Redis is tried again
    asyncio.run(attempt_then_retry())
    assert len(calls) == 2


def test_markers_are_set_only_for_attempts_a_client_may_retry(settings, monkeypatch):
    settings.REDIS_URL = "redis://127.0.0.1:6379/13"
    try:
        shared_redis.client(settings.REDIS_URL).ping()
    except redis.RedisError:
        pytest.skip("needs Redis on 127.0.0.1:6379")
    shared = SharedInFlight()
    seen = []

    async def generate(retriable: bool):
        async with shared.hold(KEY, retriable=retriable):
            seen.append(shared_redis.client(settings.REDIS_URL).exists(_name(KEY)))

    asyncio.run(generate(False))
    asyncio.run(generate(True))
    assert seen == [0, 1]
    assert shared_redis.client(settings.REDIS_URL).exists(_name(KEY)) == 0
