"""A retry that lands on another web process while the first attempt still generates gets the
first attempt's answer: the two processes share Redis (``webapp.gateway.inflight.SHARED``), as
the compose deployment's web workers do. Two uvicorn processes here, on the test database and
a Redis database of their own."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from tests.conftest import test_database_url
from tests.gateway.conftest import SERVER_ENV
from tests.gateway.test_retries import HI, RETRY, _engine_state, _slow, _until_generating
from tests.livestack import LiveStack, answers, free_port, steep_env
from webapp.accounts.keys import hash_key
from webapp.gateway import inflight
from webapp.gateway.models import Interaction, Session

pytestmark = [pytest.mark.django_db(transaction=True)]

REDIS_URL = "redis://127.0.0.1:6379/13"


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"needs Redis at {REDIS_URL}: {exc}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture(scope="module")
def two_web_processes(django_db_setup, shared_redis, tmp_path_factory) -> Iterator[list[str]]:
    """Two uvicorn processes (two web workers) on the test database, sharing ``REDIS_URL``."""
    from django.conf import settings

    env = steep_env(
        data_dir=settings.DATA_DIR,
        database_url=test_database_url(),
        redis_url=REDIS_URL,
        **SERVER_ENV,
    )
    urls = []
    with LiveStack(env=env, log_dir=tmp_path_factory.mktemp("two-webs")) as processes:
        for name in ("web-a", "web-b"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            web = processes.start_web(port, name=name)
            probe = f"{url}/agents/00000000-0000-0000-0000-000000000000/v1/models"
            processes.wait_ready(web, lambda probe=probe: answers(probe, 401), what=name)
            urls.append(url)
        yield urls


def _on(gw, server: str):
    """``gw``'s agent reached through ``server`` (another web process)."""
    return dataclasses.replace(gw, server=server, _clients=[])


def _ask(pool: ThreadPoolExecutor, on, headers: dict, **request):
    """``on``'s agent asked for a 6-token answer to ``HI`` in ``pool``, with ``headers``."""
    return pool.submit(
        on.openai().chat.completions.create,
        model=on.model,
        messages=HI,
        max_tokens=6,
        extra_headers=headers,
        **request,
    )


def _marker(gw, idempotency_key: str) -> str:
    """The Redis key an attempt with ``idempotency_key`` holds while it generates."""
    request = inflight.request_key("unused", idempotency_key)
    return inflight._name((str(gw.agent.id), hash_key(gw.key), request))


def test_a_retry_on_another_process_gets_the_answer_still_generating_once(
    gw, engine, two_web_processes
):
    a, b = (_on(gw, url) for url in two_web_processes)
    with _slow(engine), ThreadPoolExecutor(2) as pool:
        # The SDK marks its first attempt too (retry count 0); the retry goes to process B.
        first = _ask(pool, a, {"x-stainless-retry-count": "0"}, seed=3)
        _until_generating(engine)
        finished = _engine_state(engine)["num_finished_reqs"]
        retry = _ask(pool, b, RETRY, seed=3)
        first, retry = first.result(), retry.result()
        generations = _engine_state(engine)["num_finished_reqs"] - finished

    assert retry.id == first.id
    assert retry.choices[0].message.content == first.choices[0].message.content
    assert generations == 1
    assert Interaction.objects.count() == 1 and Session.objects.count() == 1


def test_a_retry_waits_while_another_process_holds_the_request_then_generates_its_own(
    gw, two_web_processes, shared_redis
):
    """A marker left by a process that died (here: set by the test): the retry waits while it
    is there, and generates once it is gone (it expires within ``MARK_TTL_S``)."""
    b = _on(gw, two_web_processes[1])
    key = {"Idempotency-Key": "agent-9-step-1"}
    marker = _marker(gw, key["Idempotency-Key"])
    shared_redis.set(marker, "a-process-that-died", px=60_000)
    with ThreadPoolExecutor(1) as pool:
        retry = _ask(pool, b, key)
        time.sleep(1.0)  # many polls (every 50 ms): a retry that ignored the marker answered
        assert not retry.done(), "the retry went on while another process held the request"
        assert Interaction.objects.count() == 0
        shared_redis.delete(marker)
        answer = retry.result(timeout=60)
    [turn] = Interaction.objects.all()
    assert answer.id == turn.id
    assert shared_redis.exists(marker) == 0, "its own marker is gone once it answered"


def test_an_attempt_that_may_be_retried_holds_a_marker_while_it_generates(
    gw, engine, two_web_processes, shared_redis
):
    a = _on(gw, two_web_processes[0])
    key = {"Idempotency-Key": "agent-9-step-2"}
    marker = _marker(gw, key["Idempotency-Key"])
    with _slow(engine), ThreadPoolExecutor(1) as pool:
        attempt = _ask(pool, a, key, seed=3)  # seeded: still generating when looked at
        _until_generating(engine)
        held = shared_redis.exists(marker)
        ttl_ms = shared_redis.pttl(marker)
        attempt.result(timeout=60)
    assert held == 1 and 0 < ttl_ms <= inflight.MARK_TTL_S * 1000
    assert shared_redis.exists(marker) == 0


def test_a_request_no_client_will_retry_writes_nothing_to_redis(
    gw, engine, two_web_processes, shared_redis
):
    # A plain HTTP client (no retry mark, no Idempotency-Key) pays no Redis round trip.
    a = _on(gw, two_web_processes[0])
    body = {"model": gw.model, "messages": HI, "max_tokens": 6, "seed": 3}
    with _slow(engine), ThreadPoolExecutor(1) as pool:
        attempt = pool.submit(a.post, "/chat/completions", body)
        _until_generating(engine)
        held = list(shared_redis.scan_iter("steep:inflight:*"))
        assert attempt.result(timeout=60).status_code == 200
    assert held == []
