"""Staleness admission: a full budget is 429 with Retry-After until training catches up."""

from __future__ import annotations

import httpx
import pytest
from openai import RateLimitError

from webapp.gateway.models import Interaction, Session
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def sync_gw(make_gateway, project, api_key):
    """Synchronous RL with batches of one: a single open episode fills the budget."""
    return make_gateway(project, api_key, max_staleness=0, batch_size=1)


def test_a_full_budget_is_429_with_retry_after_until_training_progresses(
    sync_gw, server_env, openai_error
):
    gw = sync_gw
    retry_after = server_env["GATEWAY_RETRY_AFTER_S"]
    session_id, key = gw.start_session()

    refused = gw.post("/rl/start_session")
    error = openai_error(refused, 429)
    assert error["code"] == "staleness_budget_full" and error["type"] == "rate_limit_error"
    assert refused.headers["retry-after"] == retry_after
    with pytest.raises(RateLimitError) as exc:
        gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert exc.value.response.headers["retry-after"] == retry_after
    assert Session.objects.count() == 1 and Interaction.objects.count() == 0

    # The admitted episode runs to its end.
    gw.openai(key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    assert gw.post("/rl/end_session", key=key).status_code == 200
    # Ready but not trained yet: the budget of version 0 is spent.
    openai_error(gw.post("/rl/start_session"), 429)

    Run.objects.filter(pk=gw.run.pk).update(weight_version=1)  # what the trainer does per step

    recovered = gw.post("/rl/start_session")
    assert recovered.status_code == 201, recovered.text
    new = Session.objects.get(pk=recovered.json()["session_id"])
    assert new.admitted_version == 1 and new.status == "open"


def test_a_429_for_start_session_with_a_live_key_keeps_the_old_session_open(sync_gw, openai_error):
    gw = sync_gw
    session_id, key = gw.start_session()
    gw.openai(key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)

    # Rebinding ends the old session (accepted: 1) and then finds no room for the new one.
    openai_error(gw.post("/rl/start_session", key=key), 429)

    session = Session.objects.get(pk=session_id)
    assert session.status == "open" and Session.objects.count() == 1
    assert gw.post("/rl/end_session", key=key).status_code == 200


def test_max_concurrent_rollouts_caps_open_sessions(make_gateway, project, api_key, openai_error):
    gw = make_gateway(project, api_key, max_concurrent_rollouts=2)
    gw.start_session()
    gw.start_session()
    openai_error(gw.post("/rl/start_session"), 429)
    assert Session.objects.count() == 2


def test_the_run_page_says_how_many_sessions_the_budget_refused(
    sync_gw, openai_error, gateway_url, client, owner
):
    gw = sync_gw
    gw.start_session()
    for _ in range(3):
        openai_error(gw.post("/rl/start_session"), 429)
    client.force_login(owner)  # the session row is committed: the live server sees it
    page = httpx.get(
        f"{gateway_url}/projects/{gw.run.project_id}/runs/{gw.run.id}/",
        cookies={"sessionid": client.cookies["sessionid"].value},
    ).text
    admission = page.split('id="run-admission">', 1)[1].split("</p>", 1)[0]
    assert "<b>0</b> free session slots · 1 open" in admission
    assert "<b>3</b> sessions refused this minute (429, staleness budget full)" in admission
    assert "batch_size ≥ 1.25 × N ÷ max_staleness" in admission
