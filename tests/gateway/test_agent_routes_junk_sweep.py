"""Every agent route, each with junk in one field at a time (and malformed messages): answered
in the API's own error shape or served, never a 500. test_bad_requests.py pins which status and
which ``param`` for the cases that matter; this sweep keeps a new field from slipping by."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.django_db(transaction=True)

NO_SESSION = "00000000-0000-0000-0000-000000000000"
VALID = {
    "/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/responses": {"input": "Hi", "max_output_tokens": 2},
    "/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "model": "m"},
    "/rl/start_session": {},
    "/rl/set_reward": {"session_id": NO_SESSION, "reward": 1.0},
    "/rl/end_session": {"session_id": NO_SESSION},
}
VALUES = [None, [], {}, -1, 10**30, "x" * 3000, True, 1.5, "\x00", [{}], [None], [[]], {"a": [1]}]
FIELDS = [
    *("messages", "input", "model", "max_tokens", "max_output_tokens", "tools", "tool_choice"),
    *("stop", "n", "temperature", "top_p", "seed", "stream_options", "logprobs", "top_logprobs"),
    *("response_format", "session_id", "reward", "metadata", "task_id", "system", "instructions"),
    *("previous_response_id", "user", "parallel_tool_calls", "thinking", "stop_sequences"),
    *("top_k", "store", "include", "text", "reasoning", "one_turn", "stream"),
]
MESSAGES = [
    [{"role": "user"}],
    [{"role": 5, "content": "x"}],
    [{"role": "tool", "content": "x"}],
    [{"role": "assistant", "tool_calls": [{}]}],
    [{"role": "user", "content": [{"type": "zz"}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
    [{"role": "assistant", "content": [{"type": "tool_use"}]}],
    [{"role": "user", "content": [{"type": "tool_result"}]}],
]


def _wrong(response) -> bool:
    if response.status_code >= 500:
        return True
    return response.status_code >= 400 and "error" not in response.json()


@pytest.mark.parametrize("path", list(VALID))
def test_junk_input_is_never_a_500(gw, path):
    bodies = [
        VALID[path] | {name: value}
        for name in FIELDS
        for value in VALUES
        if not (name == "stream" and value is True)  # a stream is answered as events
    ]
    bodies += [VALID[path] | {key: m} for m in MESSAGES for key in ("messages", "input")]
    wrong = []
    for body in bodies:
        response = gw.post(path, content=json.dumps(body))
        if _wrong(response):
            wrong.append((json.dumps(body)[:120], response.status_code, response.text[:200]))
    assert not wrong, wrong[:5]
