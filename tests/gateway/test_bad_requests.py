"""Malformed requests get the right 4xx in OpenAI's error shape (never a 500) and record nothing."""

from __future__ import annotations

import json

import pytest
from openai import BadRequestError

from webapp.gateway.models import Interaction, Session

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]


def _chat(**fields) -> str:
    return json.dumps({"model": "tiny-model", "messages": HI, "max_tokens": 2} | fields)


BAD_CHATS = [
    # (body, param, code)
    ('{"messages": [', None, "invalid_json"),
    ("", None, "invalid_json"),
    ("[1, 2]", None, "invalid_json"),
    ('"hello"', None, "invalid_json"),
    (json.dumps({"model": "tiny-model"}), "messages", "missing_required_parameter"),
    (_chat(messages="Hi"), "messages", "invalid_type"),
    (_chat(messages={"role": "user", "content": "Hi"}), "messages", "invalid_type"),
    (_chat(messages=[]), "messages", "invalid_type"),
    (_chat(messages=["Hi"]), "messages[0]", "invalid_type"),
    (_chat(messages=[{"role": "robot", "content": "Hi"}]), "messages[0].role", "invalid_value"),
    (_chat(messages=[{"role": "user"}]), "messages[0].content", "missing_required_parameter"),
    (_chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type"),
    (
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content",
        "invalid_value",
    ),
    (
        _chat(messages=[{"role": "assistant", "content": None, "tool_calls": "call"}]),
        "messages[0].tool_calls",
        "invalid_type",
    ),
    # The model's chat template cannot render this role.
    (_chat(messages=[{"role": "developer", "content": "Hi"}]), "messages", "invalid_value"),
    # Nor a tool call without a function name.
    (
        _chat(messages=[*HI, {"role": "assistant", "tool_calls": [{"function": {}}]}]),
        "messages",
        "invalid_value",
    ),
    # Nor one whose name is not a string (a TypeError inside the template).
    (
        _chat(messages=[*HI, {"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}]),
        "messages",
        "invalid_value",
    ),
    # Text no database can store: NUL, an unpaired surrogate escape; and nesting too deep.
    (_chat(messages=[{"role": "user", "content": "a\u0000b"}]), None, "invalid_value"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', None, "invalid_value"),
    (
        '{"messages": [{"role": "user", "content": "Hi"}], "x": ' + "[" * 5000 + "]" * 5000 + "}",
        None,
        "invalid_json",
    ),
    (_chat(model=5), "model", "invalid_type"),
    (_chat(temperature="hot"), "temperature", "invalid_type"),
    (_chat(temperature=True), "temperature", "invalid_type"),
    (_chat(temperature=2.5), "temperature", "invalid_value"),
    (_chat(top_p=1.5), "top_p", "invalid_value"),
    (_chat(n=0), "n", "invalid_value"),
    (_chat(n=17), "n", "invalid_value"),
    (_chat(n=1.5), "n", "invalid_type"),
    (_chat(stream="yes"), "stream", "invalid_type"),
    (_chat(stream_options="usage"), "stream_options", "invalid_type"),
    (_chat(max_tokens=0), "max_tokens", "invalid_value"),
    (_chat(max_tokens="10"), "max_tokens", "invalid_type"),
    (_chat(max_completion_tokens=-1), "max_completion_tokens", "invalid_value"),
    (_chat(seed="1"), "seed", "invalid_type"),
    (_chat(stop=5), "stop", "invalid_type"),
    (_chat(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_type"),
    (_chat(logprobs="yes"), "logprobs", "invalid_type"),
    (_chat(top_logprobs=3), "top_logprobs", "invalid_value"),
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (_chat(tools="get_weather"), "tools", "invalid_type"),
    (_chat(tools=[{"type": "function", "function": {}}]), "tools", "invalid_type"),
    (_chat(tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (_chat(presence_penalty=3), "presence_penalty", "invalid_value"),
    (_chat(frequency_penalty=-2.5), "frequency_penalty", "invalid_value"),
    (_chat(repetition_penalty=0), "repetition_penalty", "invalid_value"),
    (_chat(repetition_penalty=2.5), "repetition_penalty", "invalid_value"),
    (_chat(min_p=1.5), "min_p", "invalid_value"),
    (_chat(logit_bias={"50256": -100}), "logit_bias", "unsupported_parameter"),
]


def test_malformed_chat_requests_are_400_and_record_nothing(gw, openai_error):
    for body, param, code in BAD_CHATS:
        response = gw.post("/chat/completions", content=body)
        assert response.status_code == 400, (body[:100], response.text[:300])
        error = openai_error(response, 400)
        assert (error["param"], error["code"]) == (param, code), body[:100]
        assert error["type"] == "invalid_request_error"
    assert not Session.objects.exists() and not Interaction.objects.exists()


def test_the_sdk_raises_bad_request_for_a_wrong_type(gw, openai_error):
    with pytest.raises(BadRequestError) as exc:
        gw.openai().chat.completions.create(model=gw.model, messages=HI, temperature="hot")
    assert openai_error(exc.value, 400)["param"] == "temperature"
    assert not Session.objects.exists()


def test_a_body_that_is_not_json_is_400(gw, openai_error):
    for content, content_type in [
        ("messages=Hi", "application/x-www-form-urlencoded"),
        (_chat(), "text/plain"),
    ]:
        response = gw.post(
            "/chat/completions", content=content, headers={"Content-Type": content_type}
        )
        assert openai_error(response, 400)["code"] == "invalid_content_type"
    invalid_utf8 = gw.post("/chat/completions", content=b'{"messages": "\xff\xfe"}')
    assert openai_error(invalid_utf8, 400)["code"] == "invalid_json"
    assert not Session.objects.exists()


def test_an_oversize_body_is_413(gw, server_env, openai_error):
    limit = int(server_env["MAX_REQUEST_BYTES"])
    big = [{"role": "user", "content": "x" * (limit + 1)}]
    response = gw.post("/chat/completions", {"model": "m", "messages": big})
    error = openai_error(response, 413)
    assert error["code"] == "request_too_large" and str(limit) in error["message"]
    assert error["type"] == "invalid_request_error"
    assert not Session.objects.exists()


def test_an_oversize_chunked_body_without_content_length_is_413_too(gw, server_env, openai_error):
    limit = int(server_env["MAX_REQUEST_BYTES"])
    body = _chat(messages=[{"role": "user", "content": "x" * (limit + 1)}]).encode()
    chunks = (body[i : i + 8192] for i in range(0, len(body), 8192))
    response = gw.post("/chat/completions", content=chunks)
    assert openai_error(response, 413)["code"] == "request_too_large"
    assert not Session.objects.exists()


def test_an_escaped_emoji_is_text_not_a_lone_surrogate(gw):
    body = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    response = gw.post("/chat/completions", content=body)
    assert response.status_code == 200, response.text
    assert Interaction.objects.get().messages[0]["content"] == "\U0001f600"


def test_an_unknown_agent_with_a_valid_body_is_404(gw, openai_error):
    response = gw.http.post(
        f"{gw.server}/agents/00000000-0000-0000-0000-000000000000/v1/chat/completions",
        content=_chat(),
        headers={"Authorization": f"Bearer {gw.key}", "Content-Type": "application/json"},
    )
    assert openai_error(response, 404)["code"] == "agent_not_found"


def test_a_wrong_method_is_405(gw, openai_error):
    response = gw.http.get(
        gw.base_url + "/chat/completions", headers={"Authorization": f"Bearer {gw.key}"}
    )
    assert openai_error(response, 405)["code"] == "method_not_allowed"


def test_a_stop_string_the_engine_refuses_is_400_and_discards_the_one_turn_session(
    gw, openai_error
):
    # The gateway accepts it; the inference server answers 400. That is the client's fault:
    # no 503, the server stays in rotation, and the one-turn session is removed again.
    response = gw.post("/chat/completions", {"model": "m", "messages": HI, "stop": [""]})
    assert openai_error(response, 400)["code"] == "invalid_request"
    assert not Session.objects.exists() and not Interaction.objects.exists()
    assert gw.run.servers.get().healthy


BAD_REWARDS = [
    ('{"reward": ', None, "invalid_json"),
    ("[1.0]", None, "invalid_json"),
    ("{}", "reward", "missing_required_parameter"),
    ('{"reward": "high"}', "reward", "invalid_type"),
    ('{"reward": true}', "reward", "invalid_type"),
    ('{"reward": NaN}', "reward", "invalid_type"),
    ('{"reward": Infinity}', "reward", "invalid_type"),
    ('{"reward": 1e999}', "reward", "invalid_type"),
    ('{"reward": 1, "interaction_id": 5}', "interaction_id", "invalid_type"),
    ('{"reward": 1, "interaction_id": "\\u0000"}', None, "invalid_value"),
    ('{"reward": 1, "hint": ["try again"]}', "hint", "invalid_type"),
    ('{"reward": 1, "hint": "' + "x" * 8001 + '"}', "hint", "string_above_max_length"),
]


def test_malformed_rewards_are_400(gw, openai_error):
    _, key = gw.start_session()
    for body, param, code in BAD_REWARDS:
        response = gw.post("/rl/set_reward", content=body, key=key)
        assert response.status_code == 400, (body, response.text[:300])
        error = openai_error(response, 400)
        assert (error["param"], error["code"]) == (param, code), body


BAD_SESSION_STARTS = [
    ('{"task_id": ', None),
    ("[]", None),
    ('{"metadata": ["a"]}', "metadata"),
    ('{"task_id": ["a"]}', "task_id"),
    ('{"metadata": {"note": "\\ud800"}}', None),
]


def test_malformed_start_sessions_are_400_and_open_nothing(gw, openai_error):
    for body, param in BAD_SESSION_STARTS:
        response = gw.post("/rl/start_session", content=body)
        assert response.status_code == 400, (body, response.text[:300])
        assert openai_error(response, 400)["param"] == param, body
    assert not Session.objects.exists()


def test_a_reward_for_a_session_without_turns_is_409(gw, openai_error):
    _, key = gw.start_session()
    assert openai_error(gw.post("/rl/set_reward", {"reward": 1.0}, key=key), 409)["code"] == (
        "no_interaction"
    )
