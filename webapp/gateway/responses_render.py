"""A chat turn rendered in the Responses API's shapes: the Response object and its event stream.

Output items follow the chat answer: a ``message`` item with one ``output_text`` part when
it has text, then one ``function_call`` item per tool call (``call_id`` is the chat tool
call's id). Item ids are derived from the interaction id, so an SDK retry answered from the
record renders the same items.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from rl_core.jsonbytes import json_bytes
from webapp.gateway.chat_events import (
    ChatEvent,
    Completed,
    Failed,
    Started,
    TextDelta,
    ToolCallDelta,
)


def _suffix(interaction_id: str) -> str:
    return interaction_id.rsplit("-", 1)[-1]


def _message_item(interaction_id: str, text: str, status: str) -> dict:
    return {
        "type": "message",
        "id": f"msg_{_suffix(interaction_id)}",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)] if status == "completed" else [],
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(interaction_id: str, index: int, call: dict, status: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{_suffix(interaction_id)}_{index}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def _tools(request: dict) -> list[dict]:
    tools = request.get("tools") or []
    return [
        {"type": "function", "parameters": None, "strict": None, "description": None, **tool}
        for tool in tools
    ]


def _usage(usage: dict) -> dict:
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def _response(request: dict, interaction_id: str, model: str, created: int, status: str) -> dict:
    """A Response object without output: what ``response.created`` announces."""
    return {
        "id": interaction_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata") or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": True,
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": None,
        "store": True,
        "temperature": request.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": _tools(request),
        "top_p": request.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": None,
        "user": None,
    }


def render_response(request: dict, completion: dict) -> dict:
    """The Response object of a recorded chat completion (its ``id`` is the interaction id)."""
    choice = completion["choices"][0]
    message = choice["message"]
    incomplete = choice["finish_reason"] == "length"
    response = _response(
        request,
        completion["id"],
        completion["model"],
        completion["created"],
        "incomplete" if incomplete else "completed",
    )
    output = []
    if message.get("content"):
        output.append(_message_item(completion["id"], message["content"], "completed"))
    for index, call in enumerate(message.get("tool_calls") or []):
        output.append(_call_item(completion["id"], index, call, "completed"))
    response["output"] = output
    response["usage"] = _usage(completion.get("usage") or {})
    if incomplete:
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


async def response_stream(request: dict, events: AsyncIterator[ChatEvent]) -> AsyncIterator[bytes]:
    """The Responses event stream of a chat turn's events, ending in ``response.completed``
    (``response.incomplete`` when max_output_tokens cut it, ``response.failed`` after an
    ``error`` event)."""
    stream = _Stream(request)
    async with contextlib.aclosing(events) as chat:
        async for item in chat:
            for chunk in stream.on(item):
                yield chunk
            if isinstance(item, Completed | Failed):
                return


class _Stream:
    """The output items of a streamed answer, opened and closed in order: a ``message``
    item while text arrives, one ``function_call`` item per tool call."""

    def __init__(self, request: dict) -> None:
        self.request = request
        self.sequence = 0
        self.head: dict = {}
        self.items: list[dict] = []  # as added: {"item": ..., "text" or "arguments": ...}
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(payload) + b"\n\n"

    def on(self, item: ChatEvent):
        if isinstance(item, Started):
            self.head = _response(self.request, item.id, item.model, item.created, "in_progress")
            yield self.event("response.created", response=self.head)
            yield self.event("response.in_progress", response=self.head)
        elif isinstance(item, TextDelta):
            yield from self._text(item.text)
        elif isinstance(item, ToolCallDelta):
            yield from self._call(item)
        elif isinstance(item, Completed):
            yield from self._close()
            response = render_response(self.request, item.completion)
            done = "response.completed"
            if response["status"] == "incomplete":
                done = "response.incomplete"
            yield self.event(done, response=response)
        else:
            error = item.error
            yield self.event(
                "error",
                code=error.get("code"),
                message=error.get("message") or "The answer failed.",
                param=error.get("param"),
            )
            if self.head:
                failed = dict(self.head, status="failed")
                failed["error"] = {
                    "code": error.get("code") or "server_error",
                    "message": error.get("message") or "The answer failed.",
                }
                yield self.event("response.failed", response=failed)

    def _text(self, text: str):
        last = self.items[-1] if self.items else None
        if last is None or last["item"]["type"] != "message":
            yield from self._close()
            item = _message_item(self.head["id"], "", "in_progress")
            self.items.append({"item": item, "text": ""})
            index = len(self.items) - 1
            yield self.event("response.output_item.added", output_index=index, item=item)
            yield self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_text_part(""),
            )
        self.items[-1]["text"] += text
        yield self.event(
            "response.output_text.delta",
            item_id=self.items[-1]["item"]["id"],
            output_index=len(self.items) - 1,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _call(self, delta: ToolCallDelta):
        if delta.index not in self.calls:
            yield from self._close()
            call = {"id": delta.id or "", "function": {"name": delta.name or ""}}
            item = _call_item(self.head["id"], delta.index, call, "in_progress")
            self.items.append({"item": item, "arguments": ""})
            self.calls[delta.index] = len(self.items) - 1
            yield self.event(
                "response.output_item.added", output_index=len(self.items) - 1, item=item
            )
        index = self.calls[delta.index]
        if delta.arguments:
            self.items[index]["arguments"] += delta.arguments
            yield self.event(
                "response.function_call_arguments.delta",
                item_id=self.items[index]["item"]["id"],
                output_index=index,
                delta=delta.arguments,
            )

    def _close(self):
        """The done events of the item open now (the last one added), if any."""
        if not self.items or self.items[-1].get("closed"):
            return
        entry, index = self.items[-1], len(self.items) - 1
        entry["closed"] = True
        item = dict(entry["item"], status="completed")
        if item["type"] == "message":
            text = entry["text"]
            item["content"] = [_text_part(text)]
            yield self.event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield self.event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_text_part(text),
            )
        else:
            item["arguments"] = entry["arguments"]
            yield self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=entry["arguments"],
            )
        yield self.event("response.output_item.done", output_index=index, item=item)
