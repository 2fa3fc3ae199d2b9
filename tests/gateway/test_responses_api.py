"""The Responses API through the official ``openai`` SDK: each response is a chat turn,
recorded as one, rewardable by its id, and bad input gets OpenAI's error shape."""

from __future__ import annotations

import uuid

import pytest
from openai import AuthenticationError, BadRequestError, NotFoundError

from webapp.gateway.models import Interaction, Session

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_response_is_a_recorded_chat_turn_rewardable_by_its_id(gw, chat_tokenizer):
    # Greedy: a sampled stop token first would leave no message item.
    response = gw.openai().responses.create(
        model=gw.model, input="Hi", max_output_tokens=8, temperature=0
    )

    interaction = Interaction.objects.select_related("session").get(pk=response.id)
    out = interaction.outputs[0]
    assert response.object == "response" and response.model == gw.model
    assert response.status in ("completed", "incomplete")
    assert response.output_text == out["text"] == chat_tokenizer.decode(out["output_ids"])
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert interaction.messages == [{"role": "user", "content": "Hi"}]
    assert interaction.input_ids == chat_tokenizer.encode(
        chat_tokenizer.render(interaction.messages)
    )
    assert response.usage.input_tokens == len(interaction.input_ids)
    assert response.usage.output_tokens == len(out["output_ids"]) <= 8
    assert interaction.response["object"] == "chat.completion"  # the same row as a chat turn
    assert interaction.session.one_turn and interaction.session.agent_id == gw.agent.id

    reward = gw.post("/rl/set_reward", {"reward": 0.5, "interaction_id": response.id})
    assert reward.status_code == 200, reward.text
    interaction.refresh_from_db()
    assert interaction.reward == 0.5


def test_instructions_and_input_items_become_the_chat_messages(gw):
    response = gw.openai().responses.create(
        model=gw.model,
        instructions="Answer briefly.",
        input=[
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello."}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "Again"}]},
        ],
        max_output_tokens=4,
        temperature=0,
    )

    assert Interaction.objects.get(pk=response.id).messages == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]


def test_previous_response_id_continues_the_session_on_its_exact_tokens(gw):
    session_id, key = gw.start_session()
    client = gw.openai(key)

    first = client.responses.create(
        model=gw.model, instructions="Be kind.", input="Hi", max_output_tokens=6
    )
    second = client.responses.create(
        model=gw.model,
        instructions="Be kind.",
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=6,
    )
    for response, reward in ((first, 0.25), (second, 1.0)):
        answer = gw.post(
            "/rl/set_reward", {"reward": reward, "interaction_id": response.id}, key=key
        )
        assert answer.status_code == 200, answer.text
    ended = gw.post("/rl/end_session", key=key)

    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")
    assert (turn0.id, turn1.id) == (first.id, second.id)
    assert turn1.messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert turn1.prefix_reused
    assert turn1.input_ids[: len(turn0.input_ids)] == turn0.input_ids
    assert (turn0.reward, turn1.reward) == (0.25, 1.0)
    assert ended.json()["interaction_count"] == 2
    assert Session.objects.get(pk=session_id).trajectory == "ready"


def test_a_previous_response_of_another_session_is_not_found(gw, openai_error):
    _, key = gw.start_session()
    other = gw.openai().responses.create(model=gw.model, input="Hi", max_output_tokens=2)

    with pytest.raises(NotFoundError) as exc:
        gw.openai(key).responses.create(
            model=gw.model, input="Hi", previous_response_id=other.id, max_output_tokens=2
        )

    error = openai_error(exc.value, 404)
    assert (error["code"], error["param"]) == (
        "previous_response_not_found",
        "previous_response_id",
    )
    assert Interaction.objects.count() == 1


def test_a_streamed_response_sends_the_responses_events_and_records_the_streamed_text(gw):
    events = list(
        gw.openai().responses.create(
            model=gw.model, input="Hi", max_output_tokens=12, temperature=0, stream=True
        )
    )

    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    interaction = Interaction.objects.get(pk=final.id)
    text = interaction.outputs[0]["text"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == text != ""
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == text
    assert final.usage.output_tokens == len(interaction.outputs[0]["output_ids"])


BAD_REQUESTS = [
    # (body, param, code)
    ('{"input": ', None, "invalid_json"),
    ("[1]", None, "invalid_json"),
    ('{"model": "m"}', "input", "missing_required_parameter"),
    ('{"input": 5}', "input", "invalid_type"),
    ('{"input": []}', "input", "invalid_type"),
    ('{"input": [{"role": "robot", "content": "Hi"}]}', "input[0].role", "invalid_value"),
    ('{"input": [{"role": ["user"], "content": "Hi"}]}', "input[0].role", "invalid_value"),
    ('{"input": "Hi", "model": 5}', "model", "invalid_type"),
    ('{"input": [{"type": "reasoning", "summary": []}]}', "input[0].type", "invalid_value"),
    (
        '{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}',
        "input[0].content",
        "invalid_value",
    ),
    ('{"input": [{"type": "function_call", "name": "f"}]}', "input[0].call_id", "invalid_type"),
    ('{"input": "Hi", "instructions": 3}', "instructions", "invalid_type"),
    ('{"input": "Hi", "max_output_tokens": "8"}', "max_output_tokens", "invalid_type"),
    ('{"input": "Hi", "max_output_tokens": 0}', "max_output_tokens", "invalid_value"),
    ('{"input": "Hi", "temperature": "hot"}', "temperature", "invalid_type"),
    ('{"input": "Hi", "tools": [{"type": "web_search"}]}', "tools[0]", "invalid_value"),
    ('{"input": "Hi", "previous_response_id": 7}', "previous_response_id", "invalid_type"),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_REQUESTS)
def test_bad_input_is_a_400_in_openais_shape_and_records_nothing(
    gw, openai_error, body, param, code
):
    error = openai_error(gw.post("/responses", content=body), 400)
    assert (error["param"], error["code"]) == (param, code)
    assert not Interaction.objects.exists()


def test_bad_keys_and_foreign_agents_get_openais_401_and_404(gw, other_api_key, openai_error):
    with pytest.raises(AuthenticationError) as bad_key:
        gw.openai("sk-not-a-key").responses.create(model=gw.model, input="Hi")
    with pytest.raises(NotFoundError) as foreign:
        gw.openai(other_api_key).responses.create(model=gw.model, input="Hi")
    unknown = gw.http.post(
        f"{gw.server}/agents/{uuid.uuid4()}/v1/responses",
        json={"input": "Hi"},
        headers={"Authorization": f"Bearer {gw.key}"},
    )
    assert openai_error(bad_key.value, 401)["code"] == "invalid_api_key"
    foreign_error, unknown_error = openai_error(foreign.value, 404), openai_error(unknown, 404)
    assert foreign_error["code"] == unknown_error["code"] == "agent_not_found"
    assert not Interaction.objects.exists()


def test_the_sdk_sees_a_bad_request_as_bad_request_error(gw):
    with pytest.raises(BadRequestError):
        gw.openai().responses.create(model=gw.model, input="Hi", max_output_tokens=0)


async def test_djangos_route_answers_in_openais_shape(async_client, openai_error):
    # Django serves these paths when the fast route does not (e.g. not under uvicorn).
    url = f"/agents/{uuid.uuid4()}/v1/responses"
    malformed = await async_client.post(url, "{", content_type="application/json")
    wrong_method = await async_client.get(url)
    assert openai_error(malformed, 400)["code"] == "invalid_json"
    assert openai_error(wrong_method, 405)["code"] == "method_not_allowed"


def test_a_response_records_the_same_row_as_the_same_chat_turn(gw):
    client = gw.openai()
    chat = client.chat.completions.create(
        model=gw.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    response = client.responses.create(
        model=gw.model, input="Hi", max_output_tokens=6, temperature=0
    )

    by_chat, by_responses = (Interaction.objects.get(pk=i) for i in (chat.id, response.id))
    for field in ("messages", "tools", "input_ids", "sampling", "temperature", "top_p", "top_k"):
        assert getattr(by_responses, field) == getattr(by_chat, field), field
    assert by_responses.outputs[0]["output_ids"] == by_chat.outputs[0]["output_ids"]  # greedy
    assert response.output_text == chat.choices[0].message.content


def test_the_sdks_stream_helper_follows_the_events_to_an_answer_cut_by_max_output_tokens(gw):
    # As OpenAI does, an answer cut short ends in response.incomplete (not .completed).
    with gw.openai().responses.stream(
        model=gw.model, input="Hi", max_output_tokens=1, temperature=0
    ) as stream:
        events = list(stream)

    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    interaction = Interaction.objects.get(pk=final.response.id)
    assert text == final.response.output_text == interaction.outputs[0]["text"]


def test_an_sdk_retry_gets_the_recorded_response_and_records_nothing_twice(gw):
    client = gw.openai()
    first = client.responses.create(model=gw.model, input="Hi", max_output_tokens=6)
    retry = client.responses.create(
        model=gw.model,
        input="Hi",
        max_output_tokens=6,
        extra_headers={"x-stainless-retry-count": "1"},
    )

    assert (retry.id, retry.output_text) == (first.id, first.output_text)
    assert [item.id for item in retry.output] == [item.id for item in first.output]
    assert Interaction.objects.count() == 1
