"""Tool calls through the Responses and Anthropic Messages APIs, with the model fine-tuned to
call get_weather (test_tool_calls.py): the call comes out in each API's shape, plain and
streamed, and the tool's result goes back on top of the exact tokens of the call."""

from __future__ import annotations

import json

import pytest
from anthropic import Anthropic

from tests.gateway import test_tool_calls as tool_calls
from webapp.gateway.models import Interaction

pytestmark = pytest.mark.django_db(transaction=True)

# The fine-tuned model and the gateway serving it, shared with test_tool_calls.py.
tool_model_dir, tool_weights = tool_calls.tool_model_dir, tool_calls.tool_weights
tools_gw = tool_calls.tools_gw
TOOLS, TOOL_MESSAGES, TOOL_RESULT = (
    tool_calls.TOOLS,
    tool_calls.TOOL_MESSAGES,
    tool_calls.TOOL_RESULT,
)

[_FUNCTION] = [tool["function"] for tool in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **_FUNCTION}]  # Responses' flat shape
ANTHROPIC_TOOLS = [
    {
        "name": _FUNCTION["name"],
        "description": _FUNCTION["description"],
        "input_schema": _FUNCTION["parameters"],
    }
]
PARIS = {"city": "Paris"}


def _anthropic(gw, key: str | None = None) -> Anthropic:
    client = Anthropic(
        base_url=f"{gw.server}/agents/{gw.agent.id}", api_key=key or gw.key, max_retries=0
    )
    gw._clients.append(client)
    return client


def _tool_result_follows_the_call(session_id: str, chat_tokenizer_of) -> None:
    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")
    assert turn1.prefix_reused
    earlier = turn0.input_ids + turn0.outputs[0]["output_ids"]
    assert turn1.input_ids[: len(earlier)] == earlier
    prompt = chat_tokenizer_of.decode(turn1.input_ids, skip_special_tokens=False)
    assert prompt.endswith(f"<|im_start|>tool\n{TOOL_RESULT}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture
def tok(tools_gw):
    from rl_core.chat import load_chat_tokenizer

    return load_chat_tokenizer(str(tools_gw.model_dir))


def test_a_responses_function_call_round_trips_through_previous_response_id(tools_gw, tok):
    session_id, key = tools_gw.start_session()
    client = tools_gw.openai(key)

    first = client.responses.create(
        model=tools_gw.model,
        input=TOOL_MESSAGES,
        tools=RESPONSES_TOOLS,
        temperature=0,
        max_output_tokens=120,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and json.loads(call.arguments) == PARIS
    second = client.responses.create(
        model=tools_gw.model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}],
        tools=RESPONSES_TOOLS,
        temperature=0,
        max_output_tokens=8,
    )

    assert Interaction.objects.get(pk=second.id).messages[-1] == {
        "role": "tool",
        "tool_call_id": call.call_id,
        "content": TOOL_RESULT,
    }
    _tool_result_follows_the_call(session_id, tok)


def test_echoed_output_items_continue_the_conversation_like_previous_response_id(tools_gw, tok):
    session_id, key = tools_gw.start_session()
    client = tools_gw.openai(key)
    items: list = list(TOOL_MESSAGES)

    first = client.responses.create(
        model=tools_gw.model,
        input=items,
        tools=RESPONSES_TOOLS,
        temperature=0,
        max_output_tokens=120,
    )
    [call] = first.output
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT})
    client.responses.create(
        model=tools_gw.model, input=items, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=8
    )

    _tool_result_follows_the_call(session_id, tok)


def test_a_streamed_responses_function_call_sends_the_argument_events(tools_gw):
    events = list(
        tools_gw.openai().responses.create(
            model=tools_gw.model,
            input=TOOL_MESSAGES,
            tools=RESPONSES_TOOLS,
            temperature=0,
            max_output_tokens=120,
            stream=True,
        )
    )

    kinds = [event.type for event in events]
    added = next(e for e in events if e.type == "response.output_item.added")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    assert json.loads("".join(deltas)) == json.loads(done.arguments) == PARIS
    assert kinds.index("response.function_call_arguments.done") < kinds.index(
        "response.output_item.done"
    )
    assert kinds[-1] == "response.completed"
    [call] = events[-1].response.output
    assert call.call_id == added.item.call_id and json.loads(call.arguments) == PARIS


def test_an_anthropic_tool_use_round_trips_with_a_tool_result(tools_gw, tok):
    session_id, key = tools_gw.start_session()
    client = _anthropic(tools_gw, key)

    first = client.messages.create(
        model=tools_gw.model,
        max_tokens=120,
        messages=TOOL_MESSAGES,
        tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )
    [tool_use] = first.content
    assert first.stop_reason == "tool_use"
    assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "get_weather", PARIS)
    client.messages.create(
        model=tools_gw.model,
        max_tokens=8,
        messages=[
            *TOOL_MESSAGES,
            {"role": "assistant", "content": [tool_use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tool_use.id, "content": TOOL_RESULT}
                ],
            },
        ],
        tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )

    _tool_result_follows_the_call(session_id, tok)


def test_a_streamed_anthropic_tool_use_sends_input_json_deltas(tools_gw):
    events = list(
        _anthropic(tools_gw).messages.create(
            model=tools_gw.model,
            max_tokens=120,
            messages=TOOL_MESSAGES,
            tools=ANTHROPIC_TOOLS,
            stream=True,
            extra_body={"temperature": 0},
        )
    )

    start = next(e for e in events if e.type == "content_block_start")
    partial = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert (start.content_block.type, start.content_block.name) == ("tool_use", "get_weather")
    assert json.loads("".join(partial)) == PARIS
    assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["tool_use"]
    assert events[-1].type == "message_stop"
