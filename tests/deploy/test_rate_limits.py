"""Per-key rate limits: ``RATE_LIMIT_API_PER_MIN`` on the REST API, ``RATE_LIMIT_GATEWAY_PER_MIN``
on the gateway. Over the limit: 429 with ``Retry-After`` in each surface's error shape; each
key has its own budget; 0 turns limiting off at no cost.

The counters live in Redis when ``REDIS_URL`` is set (the PostgreSQL + Redis run of the
suite), else in this process; every test uses fresh keys, so buckets never collide.
"""

from __future__ import annotations

import uuid

import pytest
from django.test import Client

from webapp import ratelimit

LIMIT = 3


@pytest.fixture
def second_key(project, owner) -> str:
    from webapp.accounts.services import api_key_create

    _, plaintext = api_key_create(project=project, name="second", user=owner)
    return plaintext


def bearer(key: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def retry_after(response) -> int:
    value = int(response["Retry-After"])
    assert 1 <= value <= ratelimit.WINDOW_S
    return value


# --- REST API --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_rest_api_answers_429_with_retry_after_after_the_limit(
    client, api_key, settings, api_error
):
    settings.RATE_LIMIT_API_PER_MIN = LIMIT
    for _ in range(LIMIT):
        assert client.get("/api/v1/project/", **bearer(api_key)).status_code == 200
    response = client.get("/api/v1/project/", **bearer(api_key))
    error = api_error(response, 429)
    assert error["code"] == "rate_limited"
    assert f"Rate limit of {LIMIT} requests per minute" in error["message"]
    retry_after(response)


@pytest.mark.django_db
def test_rest_api_limits_are_per_key(client, api_key, second_key, settings):
    settings.RATE_LIMIT_API_PER_MIN = LIMIT
    for _ in range(LIMIT + 1):
        client.get("/api/v1/project/", **bearer(api_key))
    assert client.get("/api/v1/project/", **bearer(api_key)).status_code == 429
    assert client.get("/api/v1/project/", **bearer(second_key)).status_code == 200


def forget(settings, bucket: str) -> None:
    """Empty a bucket whose name outlives the test database (user ids are reused)."""
    if settings.REDIS_URL:
        ratelimit._client(settings.REDIS_URL).delete(ratelimit._PREFIX + bucket)
    ratelimit._windows.pop(bucket, None)


@pytest.mark.django_db
def test_rest_api_limits_logged_in_users_too(member_client, owner, project, settings):
    settings.RATE_LIMIT_API_PER_MIN = LIMIT
    forget(settings, f"api:user:{owner.pk}")
    headers = {"HTTP_X_STEEP_PROJECT": str(project.id)}
    for _ in range(LIMIT):
        assert member_client.get("/api/v1/runs/", **headers).status_code == 200
    assert member_client.get("/api/v1/runs/", **headers).status_code == 429
    forget(settings, f"api:user:{owner.pk}")


@pytest.mark.django_db
def test_unauthenticated_requests_are_refused_not_counted(client, settings, api_error):
    settings.RATE_LIMIT_API_PER_MIN = 1
    for _ in range(3):
        api_error(client.get("/api/v1/project/", **bearer("sk-steep-not-a-key")), 401)


@pytest.mark.django_db
def test_rest_api_limit_zero_costs_nothing(client, api_key, settings, monkeypatch):
    settings.RATE_LIMIT_API_PER_MIN = 0

    def counted(bucket):
        raise AssertionError("a counter was touched with limiting off")

    monkeypatch.setattr(ratelimit, "_redis_hit", counted)
    monkeypatch.setattr(ratelimit, "_local_hit", counted)
    for _ in range(LIMIT * 3):
        assert client.get("/api/v1/project/", **bearer(api_key)).status_code == 200


# --- Gateway ---------------------------------------------------------------------------------


@pytest.fixture
def stopped_agent(project, make_run, make_agent):
    """An agent whose run is a draft: past authentication every call is a 503. (Django's
    gateway views run their database work in the request's thread, on the test's
    transaction: ``lane.in_thread``.)"""
    return make_agent(project, run=make_run(project))


def chat(client: Client, agent, key: str):
    return client.post(
        f"/agents/{agent.id}/v1/chat/completions",
        {"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
        content_type="application/json",
        **bearer(key),
    )


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.content[:300])
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.django_db
def test_gateway_answers_429_with_retry_after_in_openais_shape(
    client, stopped_agent, api_key, settings
):
    settings.RATE_LIMIT_GATEWAY_PER_MIN = LIMIT
    for _ in range(LIMIT):
        assert (
            client.get(f"/agents/{stopped_agent.id}/v1/models", **bearer(api_key)).status_code
            == 200
        )
    response = client.get(f"/agents/{stopped_agent.id}/v1/models", **bearer(api_key))
    error = openai_error(response, 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert f"{LIMIT} requests per minute" in error["message"]
    retry_after(response)


@pytest.mark.django_db
def test_gateway_limit_applies_before_the_runs_state(client, stopped_agent, api_key, settings):
    # Authentication first, then the limit, then the run: a client hammering a stopped
    # run is slowed down like any other.
    settings.RATE_LIMIT_GATEWAY_PER_MIN = LIMIT
    for _ in range(LIMIT):
        assert openai_error(chat(client, stopped_agent, api_key), 503)["code"] == "run_not_running"
    assert openai_error(chat(client, stopped_agent, api_key), 429)["code"] == "rate_limit_exceeded"


@pytest.mark.django_db
def test_gateway_limits_are_per_key(client, stopped_agent, api_key, second_key, settings):
    settings.RATE_LIMIT_GATEWAY_PER_MIN = LIMIT
    for _ in range(LIMIT + 1):
        chat(client, stopped_agent, api_key)
    assert chat(client, stopped_agent, api_key).status_code == 429
    assert chat(client, stopped_agent, second_key).status_code == 503


@pytest.mark.django_db
def test_gateway_counts_only_authenticated_requests(client, stopped_agent, settings):
    settings.RATE_LIMIT_GATEWAY_PER_MIN = 1
    for _ in range(3):
        assert chat(client, stopped_agent, "sk-steep-not-a-key").status_code == 401


@pytest.mark.django_db
def test_gateway_limit_zero_costs_nothing(client, stopped_agent, api_key, settings, monkeypatch):
    settings.RATE_LIMIT_GATEWAY_PER_MIN = 0

    def counted(bucket, *, limit):
        raise AssertionError("the limiter was called with limiting off")

    monkeypatch.setattr(ratelimit, "hit", counted)
    for _ in range(LIMIT * 2):
        assert chat(client, stopped_agent, api_key).status_code == 503


# --- The counters ----------------------------------------------------------------------------


def test_a_window_opens_again_after_a_minute(settings, monkeypatch):
    settings.REDIS_URL = ""
    now = [1000.0]
    monkeypatch.setattr(ratelimit.time, "monotonic", lambda: now[0])
    bucket = f"test:{uuid.uuid4().hex}"
    assert ratelimit.hit(bucket, limit=2) is None
    now[0] += 20
    assert ratelimit.hit(bucket, limit=2) is None
    limited = ratelimit.hit(bucket, limit=2)
    assert limited is not None and limited.retry_after == 40
    now[0] += 40
    assert ratelimit.hit(bucket, limit=2) is None


@pytest.mark.redis
def test_redis_counters_expire_with_their_window(settings):
    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL")
    bucket = f"test:{uuid.uuid4().hex}"
    assert ratelimit.hit(bucket, limit=1) is None
    limited = ratelimit.hit(bucket, limit=1)
    assert limited is not None and 1 <= limited.retry_after <= ratelimit.WINDOW_S
    client = ratelimit._client(settings.REDIS_URL)
    assert 0 < client.ttl(ratelimit._PREFIX + bucket) <= ratelimit.WINDOW_S
    client.delete(ratelimit._PREFIX + bucket)


def test_an_unreachable_redis_lets_requests_through(settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    bucket = f"test:{uuid.uuid4().hex}"
    assert all(ratelimit.hit(bucket, limit=1) is None for _ in range(3))
