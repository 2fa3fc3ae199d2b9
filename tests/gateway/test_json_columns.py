"""JSON the gateway writes with its own SQL (``webapp.gateway.sql.insert``) reads back through
the ORM as it was sent, on SQLite and PostgreSQL: text, nesting, floats, and what the fast
writer refuses (an integer over 64 bits) all the same."""

from __future__ import annotations

import pytest

from webapp.gateway.models import Interaction, Session

pytestmark = pytest.mark.django_db(transaction=True)

METADATA = {
    "task": 'naïve café ☕ \u2028 "quoted" \\ back',
    "nested": {"list": [1, 2.5, None, True, {"deep": []}], "empty": {}},
    "small": -(2**63),
    "float": 1e-300,
}
BIG = {**METADATA, "huge": 2**70}  # over 64 bits: orjson refuses it, the ORM's writer takes it
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "count",
            "description": "Count to a number: ünïcode ok",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "maximum": 2**70}},
            },
        },
    }
]


@pytest.mark.parametrize("metadata", [METADATA, BIG], ids=["fits-64-bits", "over-64-bits"])
def test_session_metadata_reads_back_as_sent(gw, metadata):
    session_id, _ = gw.start_session(task_id="json", metadata=metadata)
    assert Session.objects.get(id=session_id).metadata == metadata


def test_a_turns_messages_and_tools_read_back_as_sent(gw):
    session_id, key = gw.start_session()
    messages = [{"role": "user", "content": METADATA["task"]}]
    response = gw.post(
        "/chat/completions",
        {"model": gw.model, "messages": messages, "tools": TOOLS, "max_tokens": 4},
        key=key,
    )
    assert response.status_code == 200, response.text
    turn = Interaction.objects.get(session_id=session_id)
    assert turn.messages == messages
    assert turn.tools == TOOLS
    assert turn.input_ids and all(isinstance(i, int) for i in turn.input_ids)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/responses",
            {
                "input": "count",
                "tools": [{"type": "function", **TOOLS[0]["function"]}],
                "max_output_tokens": 4,
            },
        ),
        (
            "/responses",
            {
                "input": "count",
                "tools": [{"type": "function", **TOOLS[0]["function"]}],
                "max_output_tokens": 4,
                "stream": True,
            },
        ),
        (
            "/messages",
            {
                "messages": [{"role": "user", "content": "count"}],
                "tools": [
                    {
                        "name": "count",
                        "description": "Count to a number",
                        "input_schema": TOOLS[0]["function"]["parameters"],
                    }
                ],
                "max_tokens": 4,
            },
        ),
    ],
    ids=["responses", "responses-streamed", "anthropic-messages"],
)
def test_other_apis_take_a_tool_schema_over_64_bits(gw, path, body):
    session_id, key = gw.start_session()
    response = gw.post(path, {"model": gw.model, **body}, key=key)
    assert response.status_code == 200, response.text
    if body.get("stream"):  # every event written, the echoed tools in the last
        assert response.text.rstrip().splitlines()[-1].startswith("data: ")
        last = response.text.rstrip().split("\n\n")[-1]
        assert last.startswith(("event: response.completed", "event: response.incomplete"))
        assert str(2**70) in last
    tools = Interaction.objects.get(session_id=session_id).tools
    assert tools[0]["function"]["parameters"]["properties"]["n"]["maximum"] == 2**70
