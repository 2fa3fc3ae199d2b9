"""SDK retries (the same request again) never record a turn twice and get the same answer."""

from __future__ import annotations

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
