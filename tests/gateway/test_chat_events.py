"""The boundary under the Responses and Messages APIs: a chat path SSE stream read as events.

Fed chunk streams shaped like the chat path's token-by-token stream (one delta per token,
SSE events split anywhere across reads), so the translations stream token by token
whatever the chat path sends, and a mid-stream error or a client gone reaches both ends.
"""

from __future__ import annotations

import orjson

from webapp.gateway.anthropic_api import message_stream
from webapp.gateway.chat_events import (
    Completed,
    Failed,
    Started,
    TextDelta,
    ToolCallDelta,
    _streamed,
)
from webapp.gateway.responses_render import response_stream

HEAD = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def _chunk(delta: dict | None = None, finish=None, usage=None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = HEAD | {"choices": choices} | ({"usage": usage} if usage else {})
    return b"data: " + orjson.dumps(body) + b"\n\n"


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
TOKEN_STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"content": "Let"}),
    _chunk({"content": " me"}),
    _chunk({"tool_calls": [{"index": 0, **CALL}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    _chunk({}, finish="tool_calls"),
    _chunk(usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}),
    b"data: [DONE]\n\n",
]


class _Source:
    """An async byte stream that remembers whether it was closed."""

    def __init__(self, chunks: list[bytes]):
        self.chunks, self.closed = chunks, False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        try:
            for chunk in self.chunks:
                yield chunk
        finally:
            self.closed = True


def _split_anywhere(chunks: list[bytes], size: int = 7) -> list[bytes]:
    data = b"".join(chunks)
    return [data[i : i + size] for i in range(0, len(data), size)]


async def _events(chunks: list[bytes]) -> list:
    return [event async for event in _streamed(_Source(chunks).__aiter__())]


async def test_each_chat_delta_becomes_one_event_and_they_add_up_to_the_completion():
    events = await _events(_split_anywhere(TOKEN_STREAM))

    assert events[0] == Started("chatcmpl-abc", "m", 7)
    assert events[1:6] == [
        TextDelta("Let"),
        TextDelta(" me"),
        ToolCallDelta(0, "call_1", "get_weather", ""),
        ToolCallDelta(0, None, None, '{"city": '),
        ToolCallDelta(0, None, None, '"Paris"}'),
    ]
    [completed] = events[6:]
    assert isinstance(completed, Completed)
    assert completed.completion["choices"] == [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "matched_stop": None,
            "message": {
                "role": "assistant",
                "content": "Let me",
                "tool_calls": [
                    CALL | {"function": CALL["function"] | {"arguments": '{"city": "Paris"}'}}
                ],
            },
        }
    ]
    assert completed.completion["usage"]["completion_tokens"] == 9


async def test_an_error_chunk_mid_stream_is_a_failed_event_and_no_completion():
    error = {
        "message": "engine died",
        "type": "api_error",
        "param": None,
        "code": "inference_error",
    }
    chunks = [*TOKEN_STREAM[:3], b"data: " + orjson.dumps({"error": error}) + b"\n\n"]

    events = await _events(chunks)

    assert events[-1] == Failed(error) and not any(isinstance(e, Completed) for e in events)


async def test_closing_the_events_early_closes_the_chat_stream_under_them():
    source = _Source(TOKEN_STREAM)
    events = _streamed(source.__aiter__())
    assert isinstance(await anext(events), Started)

    await events.aclose()

    assert source.closed


async def test_the_responses_stream_emits_each_delta_as_it_arrives():
    events = _streamed(_Source(TOKEN_STREAM).__aiter__())
    payloads = [
        orjson.loads(chunk.split(b"data: ", 1)[1]) async for chunk in response_stream({}, events)
    ]

    kinds = [p["type"] for p in payloads]
    assert [p["delta"] for p in payloads if p["type"] == "response.output_text.delta"] == [
        "Let",
        " me",
    ]
    assert [p["delta"] for p in payloads if p["type"].endswith("arguments.delta")] == [
        '{"city": ',
        '"Paris"}',
    ]
    # The message item is closed before the call's item opens, each at its own index.
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.added", 3)
    assert [p["output_index"] for p in payloads if p["type"] == "response.output_item.done"] == [
        0,
        1,
    ]
    assert [item["type"] for item in payloads[-1]["response"]["output"]] == [
        "message",
        "function_call",
    ]


async def test_the_messages_stream_emits_text_and_input_json_deltas_as_they_arrive():
    events = _streamed(_Source(TOKEN_STREAM).__aiter__())
    payloads = [
        orjson.loads(chunk.split(b"data: ", 1)[1]) async for chunk in message_stream(events)
    ]

    deltas = [p["delta"] for p in payloads if p["type"] == "content_block_delta"]
    assert deltas == [
        {"type": "text_delta", "text": "Let"},
        {"type": "text_delta", "text": " me"},
        {"type": "input_json_delta", "partial_json": '{"city": '},
        {"type": "input_json_delta", "partial_json": '"Paris"}'},
    ]
    assert [(p["type"], p.get("index")) for p in payloads if "content_block_st" in p["type"]] == [
        ("content_block_start", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_stop", 1),
    ]
    assert payloads[-2]["delta"]["stop_reason"] == "tool_use"


async def test_a_failure_mid_stream_ends_both_streams_with_their_error_events():
    error = {
        "message": "engine died",
        "type": "api_error",
        "param": None,
        "code": "inference_error",
    }
    chunks = [*TOKEN_STREAM[:3], b"data: " + orjson.dumps({"error": error}) + b"\n\n"]

    responses = [c async for c in response_stream({}, _streamed(_Source(chunks).__aiter__()))]
    messages = [c async for c in message_stream(_streamed(_Source(chunks).__aiter__()))]

    assert [orjson.loads(c.split(b"data: ", 1)[1])["type"] for c in responses[-2:]] == [
        "error",
        "response.failed",
    ]
    last = orjson.loads(messages[-1].split(b"data: ", 1)[1])
    assert last == {"type": "error", "error": {"type": "api_error", "message": "engine died"}}
