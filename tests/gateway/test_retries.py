"""SDK retries (the same request again, or the same Idempotency-Key) never record a turn twice
and get the same answer, also while the first attempt is still generating."""

from __future__ import annotations

import contextlib
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from webapp.gateway.models import Interaction, Session

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]
RETRY = {"x-stainless-retry-count": "1"}


def test_an_sdk_retry_of_a_one_turn_completion_gets_the_recorded_answer(gw):
    client = gw.openai()
    first = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=6, seed=1)

    retry = client.chat.completions.create(
        model=gw.model, messages=HI, max_tokens=6, seed=1, extra_headers=RETRY
    )

    assert retry.id == first.id
    assert retry.choices[0].message.content == first.choices[0].message.content
    assert Interaction.objects.count() == 1 and Session.objects.count() == 1


def test_the_same_request_without_the_retry_header_is_a_new_sample(gw):
    client = gw.openai()
    first = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=6)
    second = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=6)
    assert second.id != first.id
    assert Interaction.objects.count() == 2 and Session.objects.count() == 2


def test_a_retry_with_other_sampling_settings_is_not_a_replay(gw):
    client = gw.openai()
    first = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=6)
    other = client.chat.completions.create(
        model=gw.model, messages=HI, max_tokens=5, extra_headers=RETRY
    )
    assert other.id != first.id and Interaction.objects.count() == 2


def test_resending_a_sessions_last_request_replays_it_streamed_or_not(gw):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    messages: list = [*HI]
    first = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=6)
    again = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=6)
    assert again.id == first.id
    assert again.choices[0].message.content == first.choices[0].message.content

    messages += [first.choices[0].message, {"role": "user", "content": "Go on."}]
    second = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=6)
    chunks = list(
        client.chat.completions.create(
            model=gw.model, messages=messages, max_tokens=6, stream=True, extra_headers=RETRY
        )
    )
    assert {c.id for c in chunks} == {second.id}
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == second.choices[0].message.content

    session = Session.objects.get(pk=session_id)
    assert session.interaction_count == 2
    assert list(session.interactions.values_list("id", flat=True).order_by("turn")) == [
        first.id,
        second.id,
    ]


# --- a retry of a request still generating ---------------------------------------------------


@contextlib.contextmanager
def _slow(engine):
    """The engine sleeps after each forward step, so a request stays in flight a while."""
    httpx.post(engine.url + "/slow_down", json={"forward_sleep_time": 0.3}, timeout=10)
    try:
        yield
    finally:
        httpx.post(engine.url + "/slow_down", json={"forward_sleep_time": None}, timeout=10)


def _engine_state(engine) -> dict:
    return httpx.get(engine.url + "/get_server_info", timeout=10).json()["internal_states"][0]


def _until_generating(engine) -> None:
    for _ in range(600):
        if _engine_state(engine)["num_running_reqs"]:
            return
        time.sleep(0.05)
    raise AssertionError("the first attempt never reached the engine")


def _first_and_retry(gw, engine, client, retry_headers: dict, first_headers: dict | None = None):
    """The first attempt, then, while the engine generates it, the retry; both answers and how
    many generations the engine finished meanwhile."""
    create = functools.partial(
        client.chat.completions.create, model=gw.model, messages=HI, max_tokens=6, seed=3
    )
    with _slow(engine), ThreadPoolExecutor(2) as pool:
        first = pool.submit(create, extra_headers=first_headers or {})
        _until_generating(engine)
        finished = _engine_state(engine)["num_finished_reqs"]
        retry = pool.submit(create, extra_headers=retry_headers)
        answers = first.result(), retry.result()
    return answers, _engine_state(engine)["num_finished_reqs"] - finished


def test_an_sdk_retry_of_a_project_key_request_still_generating_gets_its_answer_once(gw, engine):
    (first, retry), generations = _first_and_retry(gw, engine, gw.openai(), RETRY)
    assert retry.id == first.id
    assert retry.choices[0].message.content == first.choices[0].message.content
    assert generations == 1
    assert Interaction.objects.count() == 1 and Session.objects.count() == 1


def test_an_idempotency_key_dedups_a_request_still_generating(gw, engine):
    key = {"Idempotency-Key": "agent-7-step-3"}
    (first, again), generations = _first_and_retry(gw, engine, gw.openai(), key, key)
    assert again.id == first.id and generations == 1
    assert Interaction.objects.count() == 1


def test_an_idempotency_key_gets_the_recorded_answer_after_the_first_finished(gw):
    client = gw.openai()
    key = {"Idempotency-Key": "agent-7-step-4"}
    first = client.chat.completions.create(
        model=gw.model, messages=HI, max_tokens=6, extra_headers=key
    )
    again = client.chat.completions.create(
        model=gw.model, messages=HI, max_tokens=6, extra_headers=key
    )
    other = client.chat.completions.create(
        model=gw.model, messages=HI, max_tokens=6, extra_headers={"Idempotency-Key": "other"}
    )
    assert again.id == first.id and other.id != first.id
    assert Interaction.objects.count() == 2


def test_the_same_body_without_a_retry_mark_is_sampled_again_even_while_the_first_generates(
    gw, engine
):
    (first, second), generations = _first_and_retry(gw, engine, gw.openai(), {})
    assert second.id != first.id and generations == 2
    assert Interaction.objects.count() == 2


@pytest.mark.parametrize("in_session", [False, True])
def test_an_sdk_that_times_out_and_retries_by_itself_records_one_turn(gw, engine, in_session):
    # The SDK's own retries: each attempt gives up after 0.5 s while the engine needs longer;
    # the gateway goes on generating the first attempt and answers the retries with it.
    key = gw.start_session()[1] if in_session else None
    client = gw.openai(key, timeout=0.5, max_retries=8)
    with _slow(engine):
        answer = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=6, seed=5)
    [turn] = Interaction.objects.all()
    assert answer.id == turn.id
    assert answer.choices[0].message.content == turn.response["choices"][0]["message"]["content"]
