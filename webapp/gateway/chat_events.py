"""One chat turn as events: the boundary the Responses and Anthropic Messages APIs stand on.

Both APIs are translations: their request becomes a chat-completions body, which goes
through ``completions.chat_completion`` itself, so a turn made through them is
authenticated, admitted, rendered, generated and recorded by the very code that serves
``/chat/completions`` (same rows, same errors, same durability). What comes back is
read here as a stream of events:

    Started(id, model, created)  TextDelta* / ToolCallDelta*  Completed(completion)
                                                         or   Failed(error)

``Completed.completion`` is the turn's chat completion as recorded (``id`` is the
interaction id; a streamed one is assembled from its chunks). A streamed turn is read from the chat path's own SSE chunks, so when
that path streams token by token, these events, and the APIs built on them, do too;
a non-streamed turn yields ``Started`` and ``Completed`` only. Closing the iterator
closes the chat stream under it (a client that went away is the chat path's to handle).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson

from rl_core.jsonbytes import json_bytes
from webapp.gateway.completions import chat_completion
from webapp.gateway.errors import GatewayError
from webapp.gateway.lane import in_lane
from webapp.gateway.replies import Reply


@dataclass(frozen=True)
class Started:
    id: str  # the interaction id
    model: str
    created: int


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of tool call ``index``: its id and name come with its first piece."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class Completed:
    completion: dict  # OpenAI's chat.completion, one choice, with usage


@dataclass(frozen=True)
class Failed:
    """An error after the answer began (the status line was already sent)."""

    error: dict  # OpenAI's {"message", "type", "param", "code"}


ChatEvent = Started | TextDelta | ToolCallDelta | Completed | Failed


@dataclass
class ChatTurn:
    """A turn that was refused before it began (``refusal``: the chat path's error Reply,
    in OpenAI's shape) or its ``events``."""

    refusal: Reply | None = None
    events: AsyncIterator[ChatEvent] | None = None


async def chat_turn(
    *,
    agent_id: str,
    authorization: str,
    chat_body: dict,
    retry_count: str = "",
    idempotency_key: str = "",
    db=in_lane,
) -> ChatTurn:
    """Run ``chat_body`` (a chat-completions request, one choice) as a turn of the agent."""
    stream = bool(chat_body.get("stream"))
    if stream:
        chat_body = chat_body | {"stream_options": {"include_usage": True}}
    reply = await chat_completion(
        agent_id=agent_id,
        authorization=authorization,
        content_type="application/json",
        body=json_bytes(chat_body),
        retry_count=retry_count,
        idempotency_key=idempotency_key,
        db=db,
    )
    if reply.status != 200:
        return ChatTurn(refusal=reply)
    if reply.stream is None:
        return ChatTurn(events=_whole(orjson.loads(reply.body)))
    return ChatTurn(events=_streamed(reply.stream))


async def final_completion(events: AsyncIterator[ChatEvent]) -> dict:
    """The recorded completion the events end with; a failure is its GatewayError."""
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Completed):
                return event.completion
            if isinstance(event, Failed):
                error = event.error
                raise GatewayError(
                    502, error.get("message") or "The answer failed.", code=error.get("code")
                )
    raise GatewayError(502, "The answer ended before it was complete.", code="incomplete_answer")


async def _whole(completion: dict) -> AsyncIterator[ChatEvent]:
    yield Started(completion["id"], completion["model"], completion["created"])
    yield Completed(completion)


async def _streamed(chunks: AsyncIterator[bytes]) -> AsyncIterator[ChatEvent]:
    """Events of the chat path's SSE stream, and the completion its chunks add up to."""
    head: dict | None = None
    text: list[str] = []
    calls: dict[int, dict] = {}
    finish, usage, matched = None, None, None
    async with contextlib.aclosing(_sse_data(chunks)) as data:
        async for chunk in data:
            if "error" in chunk:
                yield Failed(chunk["error"])
                return
            if head is None:
                head = chunk
                yield Started(chunk["id"], chunk["model"], chunk["created"])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue  # the adapters ask for one choice
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                    yield TextDelta(delta["content"])
                for call in delta.get("tool_calls") or []:
                    yield _tool_call_delta(call, calls)
                finish = choice.get("finish_reason") or finish
                matched = choice.get("matched_stop") or matched
    if head is None:
        yield Failed({"message": "The answer ended before it began.", "type": "api_error"})
        return
    yield Completed(_completion(head, "".join(text), calls, finish, usage, matched))


def _tool_call_delta(call: dict, calls: dict[int, dict]) -> ToolCallDelta:
    function = call.get("function") or {}
    index = int(call.get("index", len(calls)))
    known = calls.setdefault(index, {"id": None, "name": None, "arguments": ""})
    known["id"] = known["id"] or call.get("id")
    known["name"] = known["name"] or function.get("name")
    known["arguments"] += function.get("arguments") or ""
    return ToolCallDelta(
        index, call.get("id"), function.get("name"), function.get("arguments") or ""
    )


def _completion(
    head: dict, text: str, calls: dict[int, dict], finish, usage, matched_stop=None
) -> dict:
    message: dict = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for _, call in sorted(calls.items())
        ]
    return {
        "id": head["id"],
        "object": "chat.completion",
        "created": head["created"],
        "model": head["model"],
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish or "stop",
                "matched_stop": matched_stop,
            }
        ],
        "usage": usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


async def _sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The JSON ``data:`` payloads of an SSE byte stream, up to ``[DONE]``."""
    buffer = b""
    try:
        async for piece in chunks:
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    yield orjson.loads(payload)
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
