"""Anthropic's Messages API through the official ``anthropic`` SDK (base_url: the agent's URL
without ``/v1``): each message is a chat turn, recorded as one, and errors are Anthropic's."""

from __future__ import annotations

import uuid

import pytest
from anthropic import Anthropic, AuthenticationError, BadRequestError, NotFoundError

from webapp.gateway.models import Interaction, Session

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]
# This SDK version has no sampling arguments; the API's temperature / top_p / top_k go as body fields.
GREEDY = {"temperature": 0}


def _client(gw, key: str | None = None, **kwargs) -> Anthropic:
    client = Anthropic(
        base_url=f"{gw.server}/agents/{gw.agent.id}",
        api_key=key or gw.key,
        max_retries=0,
        timeout=60,
        **kwargs,
    )
    gw._clients.append(client)
    return client


def _anthropic_error(response, status: int) -> dict:
    """Assert ``response`` (httpx response or SDK error) is Anthropic's error shape."""
    response = getattr(response, "response", response)
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


def _post(gw, body=None, *, content: str | None = None, headers: dict | None = None):
    url = f"{gw.base_url}/messages"
    headers = {"x-api-key": gw.key, **(headers or {})}
    if content is not None:
        headers.setdefault("Content-Type", "application/json")
        return gw.http.post(url, content=content, headers=headers)
    return gw.http.post(url, json=body, headers=headers)


def test_a_message_is_a_recorded_chat_turn_rewardable_by_its_id(gw, chat_tokenizer):
    # Greedy: a sampled stop token first would leave no text block.
    message = _client(gw).messages.create(
        model=gw.model, max_tokens=8, messages=HI, extra_body=GREEDY
    )

    interaction = Interaction.objects.select_related("session").get(pk=message.id)
    out = interaction.outputs[0]
    assert (message.type, message.role, message.model) == ("message", "assistant", gw.model)
    [block] = message.content
    assert block.type == "text" and block.text == out["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert interaction.messages == HI
    assert interaction.input_ids == chat_tokenizer.encode(chat_tokenizer.render(HI))
    assert message.usage.input_tokens == len(interaction.input_ids)
    assert message.usage.output_tokens == len(out["output_ids"]) <= 8
    assert interaction.response["object"] == "chat.completion"  # the same row as a chat turn
    assert interaction.session.one_turn

    reward = gw.post("/rl/set_reward", {"reward": 1.0, "interaction_id": message.id})
    assert reward.status_code == 200, reward.text
    interaction.refresh_from_db()
    assert interaction.reward == 1.0


def test_sampling_fields_and_stop_sequences_are_the_turns_sampling(gw):
    message = _client(gw).messages.create(
        model=gw.model,
        max_tokens=4,
        messages=HI,
        stop_sequences=["###"],
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
    )

    interaction = Interaction.objects.get(pk=message.id)
    assert (interaction.temperature, interaction.top_p, interaction.top_k) == (0.5, 0.9, 20)
    assert interaction.sampling["stop"] == ["###"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_that_ends_the_answer_is_reported_as_anthropics_stop_sequence(gw, stream):
    client = _client(gw)
    free = client.messages.create(model=gw.model, max_tokens=12, messages=HI, extra_body=GREEDY)
    text = free.content[0].text
    # A piece of the greedy answer that occurs there first: the same request stopped by it
    stop = next(text[k : k + 2] for k in range(1, len(text) - 1) if text.find(text[k : k + 2]) == k)
    asked = dict(model=gw.model, max_tokens=12, messages=HI, stop_sequences=[stop, "@@@@"])
    if stream:
        events = list(client.messages.create(**asked, stream=True, extra_body=GREEDY))
        delta = events[-2].delta
        said = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        reason, sequence = delta.stop_reason, delta.stop_sequence
    else:
        message = client.messages.create(**asked, extra_body=GREEDY)
        said, reason, sequence = message.content[0].text, message.stop_reason, message.stop_sequence
    assert (said, reason, sequence) == (text[: text.find(stop)], "stop_sequence", stop)


def test_a_bearer_key_works_as_well_as_x_api_key(gw):
    response = gw.http.post(
        f"{gw.base_url}/messages",
        json={"max_tokens": 2, "messages": HI},
        headers={"Authorization": f"Bearer {gw.key}"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"


def test_a_session_over_several_messages_extends_the_exact_tokens_and_trains(gw):
    session_id, key = gw.start_session()
    client = _client(gw, key)
    system = [{"type": "text", "text": "Be kind."}]

    # Greedy: a sampled answer may end in text the API does not give back as it was (an
    # empty or whitespace-only block), and the next turn then rightly renders afresh.
    first = client.messages.create(
        model=gw.model, max_tokens=6, system=system, messages=HI, extra_body=GREEDY
    )
    conversation = [
        *HI,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
    ]
    second = client.messages.create(
        model=gw.model, max_tokens=6, system="Be kind.", messages=conversation, extra_body=GREEDY
    )
    assert gw.post("/rl/set_reward", {"reward": 0.5}, key=key).status_code == 200
    ended = gw.post("/rl/end_session", key=key)

    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")
    assert (turn0.id, turn1.id) == (first.id, second.id)
    assert turn1.messages == [
        {"role": "system", "content": "Be kind."},
        *HI,
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "And then?"},
    ]
    assert turn1.prefix_reused
    assert turn1.input_ids[: len(turn0.input_ids)] == turn0.input_ids
    assert turn1.reward == 0.5
    assert ended.json()["interaction_count"] == 2
    assert Session.objects.get(pk=session_id).trajectory == "ready"


def test_a_streamed_message_sends_anthropics_events_and_records_the_streamed_text(gw):
    events = list(
        _client(gw).messages.create(
            model=gw.model, max_tokens=12, messages=HI, stream=True, extra_body=GREEDY
        )
    )

    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:3] == ["content_block_start", "content_block_delta"]
    assert kinds[-3] == "content_block_stop"
    interaction = Interaction.objects.get(pk=events[0].message.id)
    out = interaction.outputs[0]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == out["text"] != ""
    assert events[-2].delta.stop_reason in ("end_turn", "max_tokens")
    assert events[-2].usage.output_tokens == len(out["output_ids"])


def test_the_sdks_stream_helper_assembles_the_recorded_message(gw):
    with _client(gw).messages.stream(
        model=gw.model, max_tokens=10, messages=HI, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()

    interaction = Interaction.objects.get(pk=message.id)
    assert text == message.content[0].text == interaction.outputs[0]["text"]
    assert message.usage.input_tokens == len(interaction.input_ids)


BAD_REQUESTS = [
    '{"max_tokens": ',
    "[1]",
    '{"messages": [{"role": "user", "content": "Hi"}]}',  # max_tokens is required
    '{"max_tokens": "8", "messages": [{"role": "user", "content": "Hi"}]}',
    '{"max_tokens": 8}',
    '{"max_tokens": 8, "messages": "Hi"}',
    '{"max_tokens": 8, "messages": [{"role": "system", "content": "Hi"}]}',
    '{"max_tokens": 8, "messages": [{"role": ["user"], "content": "Hi"}]}',
    '{"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}',
    '{"max_tokens": 8, "tool_choice": {"type": "maybe"}, "tools": [{"name": "f"}],'
    ' "messages": [{"role": "user", "content": "Hi"}]}',
    '{"max_tokens": 8, "messages": [{"role": "user", "content": 5}]}',
    '{"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
    '{"max_tokens": 8, "system": 5, "messages": [{"role": "user", "content": "Hi"}]}',
    '{"max_tokens": 8, "stop_sequences": "x", "messages": [{"role": "user", "content": "Hi"}]}',
    '{"max_tokens": 8, "temperature": "hot", "messages": [{"role": "user", "content": "Hi"}]}',
    '{"max_tokens": 8, "tools": [{"type": "bash_20250124", "name": "bash"}],'
    ' "messages": [{"role": "user", "content": "Hi"}]}',
]


@pytest.mark.parametrize("body", BAD_REQUESTS)
def test_bad_input_is_a_400_in_anthropics_shape_and_records_nothing(gw, body):
    error = _anthropic_error(_post(gw, content=body), 400)
    assert error["type"] == "invalid_request_error"
    assert not Interaction.objects.exists()


def test_bad_keys_and_foreign_agents_get_anthropics_401_and_404(gw, other_api_key):
    with pytest.raises(AuthenticationError) as bad_key:
        _client(gw, "sk-not-a-key").messages.create(model=gw.model, max_tokens=2, messages=HI)
    with pytest.raises(NotFoundError) as foreign:
        _client(gw, other_api_key).messages.create(model=gw.model, max_tokens=2, messages=HI)
    unknown = gw.http.post(
        f"{gw.server}/agents/{uuid.uuid4()}/v1/messages",
        json={"max_tokens": 2, "messages": HI},
        headers={"x-api-key": gw.key},
    )
    missing = _post(gw, {"max_tokens": 2, "messages": HI}, headers={"x-api-key": ""})

    assert _anthropic_error(bad_key.value, 401)["type"] == "authentication_error"
    assert _anthropic_error(missing, 401)["type"] == "authentication_error"
    foreign_error = _anthropic_error(foreign.value, 404)
    unknown_error = _anthropic_error(unknown, 404)
    assert foreign_error["type"] == unknown_error["type"] == "not_found_error"
    assert not Interaction.objects.exists()


def test_the_routes_own_refusals_are_in_anthropics_shape_too(gw):
    wrong_method = gw.http.get(f"{gw.base_url}/messages", headers={"x-api-key": gw.key})
    too_large = _post(gw, content='{"x": "' + "a" * 70_000 + '"}')

    assert _anthropic_error(wrong_method, 405)["type"] == "invalid_request_error"
    assert _anthropic_error(too_large, 413)["type"] == "request_too_large"


def test_the_sdk_sees_a_bad_request_as_bad_request_error(gw):
    with pytest.raises(BadRequestError):
        _client(gw).messages.create(model=gw.model, max_tokens=0, messages=HI)


@pytest.mark.parametrize(
    ("method", "body", "status"), [("get", None, 405), ("post", "{", 400), ("post", "{}", 400)]
)
async def test_djangos_route_answers_in_anthropics_shape_too(async_client, method, body, status):
    # Django serves these paths when the fast route does not (e.g. not under uvicorn).
    url = f"/agents/{uuid.uuid4()}/v1/messages"
    if method == "get":
        response = await async_client.get(url)
    else:
        response = await async_client.post(url, body, content_type="application/json")
    assert response.status_code == status
    assert response.json()["type"] == "error" and set(response.json()["error"]) == {
        "type",
        "message",
    }


def test_session_and_run_refusals_keep_the_chat_paths_status_codes(
    gw, make_gateway, project, api_key
):
    from anthropic import ConflictError, InternalServerError

    _, key = gw.start_session()
    assert gw.post("/rl/end_session", key=key).status_code == 200
    with pytest.raises(ConflictError) as ended:
        _client(gw, key).messages.create(model=gw.model, max_tokens=2, messages=HI)
    stopped = make_gateway(project, api_key, running=False, name="stopped")
    with pytest.raises(InternalServerError) as not_running:
        _client(stopped).messages.create(model=gw.model, max_tokens=2, messages=HI)

    assert _anthropic_error(ended.value, 409)["type"] == "invalid_request_error"
    assert _anthropic_error(not_running.value, 503)["type"] == "overloaded_error"


def test_a_message_records_the_same_row_as_the_same_chat_turn(gw):
    chat = gw.openai().chat.completions.create(
        model=gw.model, messages=HI, max_tokens=6, temperature=0, stop=["###"]
    )
    message = _client(gw).messages.create(
        model=gw.model, max_tokens=6, messages=HI, stop_sequences=["###"], extra_body=GREEDY
    )

    by_chat, by_messages = (Interaction.objects.get(pk=i) for i in (chat.id, message.id))
    for field in ("messages", "tools", "input_ids", "sampling", "temperature", "top_p", "top_k"):
        assert getattr(by_messages, field) == getattr(by_chat, field), field
    assert by_messages.outputs[0]["output_ids"] == by_chat.outputs[0]["output_ids"]  # greedy


def test_an_sdk_retry_gets_the_recorded_message_and_records_nothing_twice(gw):
    first = _client(gw).messages.create(model=gw.model, max_tokens=6, messages=HI)
    retry = _client(gw).messages.create(
        model=gw.model,
        max_tokens=6,
        messages=HI,
        extra_headers={"x-stainless-retry-count": "1"},
    )

    assert (retry.id, retry.content) == (first.id, first.content)
    assert Interaction.objects.count() == 1
