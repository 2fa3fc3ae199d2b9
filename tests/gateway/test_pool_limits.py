"""A pool's max_requests_per_run: over it, a 429 with Retry-After naming the limit."""

from __future__ import annotations

import asyncio

import pytest

from webapp.gateway.errors import GatewayError
from webapp.pools import limits
from webapp.pools.services import pool_create

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_limits():
    limits.clear()
    yield
    limits.clear()


def test_a_run_over_its_pool_request_limit_gets_a_429_naming_it(
    make_gateway, project, api_key, tiny_model_dir, openai_error
):
    pool_create(name="shared", base_model=str(tiny_model_dir), max_requests_per_run=1, start=False)
    gw = make_gateway(project, api_key, lora_rank=8, inference_pool="shared")
    ask = {"model": gw.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for stream in (False, True):
        response = gw.post("/chat/completions", {**ask, "n": 2, "stream": stream})
        error = openai_error(response, 429)
        assert error["code"] == "pool_requests_per_run"
        assert "max_requests_per_run is 1" in error["message"] and "'shared'" in error["message"]
        assert response.headers["Retry-After"] == "1"
    # Within the limit, it is served (and what was counted came back).
    assert gw.post("/chat/completions", ask).status_code == 200
    assert gw.post("/chat/completions", {**ask, "stream": True}).status_code == 200
    assert gw.post("/chat/completions", ask).status_code == 200


def test_a_run_over_its_pool_session_limit_gets_a_429_naming_it(
    make_gateway, project, api_key, tiny_model_dir, openai_error
):
    pool_create(name="few", base_model=str(tiny_model_dir), max_sessions_per_run=1, start=False)
    gw = make_gateway(project, api_key, lora_rank=8, inference_pool="few")
    first, first_key = gw.start_session()
    refused = gw.post("/rl/start_session", {})
    error = openai_error(refused, 429)
    assert error["code"] == "pool_sessions_per_run"
    assert "max_sessions_per_run is 1" in error["message"] and "'few'" in error["message"]
    assert refused.headers["Retry-After"] == "3"  # GATEWAY_RETRY_AFTER_S of the live server
    ended = gw.post("/rl/end_session", {}, key=first_key)
    assert ended.status_code == 200, ended.text
    gw.start_session()  # the ended session's slot is free again


def test_a_run_whose_pool_is_down_gets_a_503_naming_the_pool(
    make_gateway, project, api_key, tiny_model_dir, openai_error
):
    pool_create(name="down", base_model=str(tiny_model_dir), start=False)
    gw = make_gateway(project, api_key, servers=[], lora_rank=8, inference_pool="down")
    ask = {"model": gw.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for stream in (False, True):
        response = gw.post("/chat/completions", {**ask, "stream": stream})
        error = openai_error(response, 503)
        assert error["code"] == "pool_unavailable" and "'down'" in error["message"]
        assert response.headers["Retry-After"] == "5"


def test_requests_in_flight_hold_their_share_until_given_back(pool_with_limit):
    async def scenario():
        assert await limits.take("run-a", "shared", 1) == 1
        with pytest.raises(GatewayError) as refused:
            await limits.take("run-a", "shared", 1)
        assert refused.value.status == 429 and refused.value.retry_after == limits.RETRY_AFTER_S
        assert await limits.take("run-b", "shared", 1) == 1  # another run has its own share
        limits.give_back("run-a", 1)
        assert await limits.take("run-a", "shared", 1) == 1
        assert await limits.take("run-a", "", 5) == 0  # not on a pool: nothing counted

    asyncio.run(scenario())


@pytest.fixture
def pool_with_limit(db):
    return pool_create(name="shared", base_model="tiny-llama", max_requests_per_run=1, start=False)
