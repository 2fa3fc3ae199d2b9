"""Anthropic's Messages API: ``POST /agents/{agent_id}/v1/messages``, a translation onto chat turns.

The official ``anthropic`` SDK appends ``/v1/messages`` to its ``base_url``, so an Anthropic
client takes ``{SITE_URL}/agents/{agent_id}`` (no ``/v1``) as its base_url. The key goes in
``x-api-key`` (the SDK's ``api_key``) or ``Authorization: Bearer`` (its ``auth_token``):
a session key or the project key, as on the chat path.

The request becomes a chat-completions body (``system`` → a system message, ``tool_use``
blocks → an assistant's ``tool_calls``, ``tool_result`` blocks → tool messages, tools'
``input_schema`` → ``parameters``, ``stop_sequences`` → ``stop``) and runs as one chat turn
(``chat_events.chat_turn``): recorded exactly like a chat turn, the message ``id`` being
the interaction id. Errors keep the chat path's status codes in Anthropic's shape
``{"type": "error", "error": {"type", "message"}}``.

``stop_reason``: ``tool_use`` when the answer calls tools, ``max_tokens`` when it was cut,
``stop_sequence`` (with the sequence in ``stop_sequence``) when one of ``stop_sequences``
ended it (the chat turn's ``matched_stop``), otherwise ``end_turn``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import orjson

from webapp.gateway.chat_events import (
    ChatEvent,
    Completed,
    Failed,
    Started,
    TextDelta,
    ToolCallDelta,
    chat_turn,
    final_completion,
)
from webapp.gateway.chat_request import parse_json_body
from webapp.gateway.errors import GatewayError, bad_request
from webapp.gateway.lane import in_lane
from webapp.gateway.replies import Reply

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


async def create_message(
    *,
    agent_id: str,
    authorization: str,
    content_type: str,
    body: bytes,
    api_key: str = "",
    retry_count: str = "",
    idempotency_key: str = "",
    db=in_lane,
) -> Reply:
    """``POST /agents/{agent_id}/v1/messages``; every failure is a Reply in Anthropic's error shape."""
    if api_key:
        authorization = f"Bearer {api_key}"
    try:
        request = parse_json_body(body, content_type)
        turn = await chat_turn(
            agent_id=agent_id,
            authorization=authorization,
            chat_body=chat_body(request),
            retry_count=retry_count,
            idempotency_key=idempotency_key,
            db=db,
        )
        if turn.refusal is not None:
            return anthropic_error(turn.refusal)
        if request.get("stream"):
            return Reply.sse(message_stream(turn.events))
        return Reply.json(render_message(await final_completion(turn.events)))
    except GatewayError as exc:
        return anthropic_error(Reply.error(exc))


def anthropic_error(reply: Reply) -> Reply:
    """An error Reply in OpenAI's shape (the chat path's) as Anthropic's; same status and headers."""
    error = orjson.loads(reply.body).get("error") or {}
    body = {
        "type": "error",
        "error": {
            "type": _ERROR_TYPES.get(reply.status, "api_error"),
            "message": error.get("message", ""),
        },
    }
    return Reply(reply.status, orjson.dumps(body), headers=dict(reply.headers), reason=reply.reason)


# --- Request -----------------------------------------------------------------------------


def chat_body(request: Any) -> dict:
    """An Anthropic Messages request as a chat-completions request body."""
    if not isinstance(request, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    if "model" in request and not isinstance(request["model"], str):
        raise bad_request("model: must be a string.", param="model", code="invalid_type")
    max_tokens = request.get("max_tokens")
    if max_tokens is None:
        raise bad_request("max_tokens: Field required", param="max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request("max_tokens: must be an integer of at least 1.", param="max_tokens")
    body: dict[str, Any] = {
        "model": request.get("model") or "",
        "messages": [*_system(request.get("system")), *_messages(request.get("messages"))],
        "max_tokens": max_tokens,
    }
    for name in ("temperature", "top_p", "top_k", "stream"):
        if request.get(name) is not None:
            body[name] = request[name]
    stops = request.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("stop_sequences: must be a list of strings.", param="stop_sequences")
        body["stop"] = stops
    tools = _tools(request.get("tools"))
    if tools:
        body["tools"] = tools
        body["tool_choice"] = _tool_choice(request.get("tool_choice"))
    return body


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, list):
        system = _text_blocks(system, "system")
    if not isinstance(system, str):
        raise bad_request("system: must be a string or a list of text blocks.", param="system")
    return [{"role": "system", "content": system}] if system else []


def _messages(messages: Any) -> list[dict]:
    if messages is None:
        raise bad_request("messages: Field required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list.", param="messages")
    out: list[dict] = []
    for index, message in enumerate(messages):
        param = f"messages.{index}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(
                f"{param}: a message is {{role: 'user' | 'assistant', content}}.", param=param
            )
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out.extend(_blocks(message["role"], content, f"{param}.content"))
        else:
            raise bad_request(
                f"{param}.content: must be a string or a list of content blocks.",
                param=f"{param}.content",
            )
    return out


def _blocks(role: str, blocks: list, param: str) -> list[dict]:
    """One Anthropic message's blocks as chat messages: an assistant's text and tool_use
    blocks are one answer; a user's tool_result blocks are tool messages, before its text."""
    texts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for index, block in enumerate(blocks):
        where = f"{param}.{index}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{where}: tool_use needs a string id and name.", param=where)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {
                        "name": block["name"],
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{where}: tool_result needs a string tool_use_id.", param=where)
            content = block.get("content", "")
            if isinstance(content, list):
                content = _text_blocks(content, f"{where}.content")
            if not isinstance(content, str):
                raise bad_request(f"{where}.content: must be text.", param=f"{where}.content")
            results.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
            )
        else:
            raise bad_request(
                f"{where}: only text blocks, an assistant's tool_use and a user's tool_result "
                "blocks are supported.",
                param=where,
            )
    if role == "assistant":
        message: dict = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        return [message]
    return [*results, *([{"role": "user", "content": "".join(texts)}] if texts else [])]


def _text_blocks(blocks: list, param: str) -> str:
    if not all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in blocks
    ):
        raise bad_request(f"{param}: only text blocks are supported.", param=param)
    return "".join(b["text"] for b in blocks)


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list.", param="tools")
    chat_tools = []
    for index, tool in enumerate(tools):
        param = f"tools.{index}"
        if (
            not isinstance(tool, dict)
            or tool.get("type") not in (None, "custom")
            or not isinstance(tool.get("name"), str)
        ):
            raise bad_request(
                f"{param}: only client tools {{name, description?, input_schema}} are supported.",
                param=param,
            )
        # Key order as chat tools are usually written: the template renders them as JSON.
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice: must be {type: 'auto' | 'any' | 'none'} or {type: 'tool', name}.",
        param="tool_choice",
    )


# --- Response ----------------------------------------------------------------------------


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(usage: dict) -> dict:
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _head(message_id: str, model: str) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


def render_message(completion: dict) -> dict:
    """The Message of a recorded chat completion (its ``id`` is the interaction id)."""
    choice = completion["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": _input(call["function"]["arguments"]),
            }
        )
    matched = choice.get("matched_stop") if choice["finish_reason"] == "stop" else None
    return _head(completion["id"], completion["model"]) | {
        "content": content,
        "stop_reason": "stop_sequence"
        if matched
        else _STOP_REASONS.get(choice["finish_reason"], "end_turn"),
        "stop_sequence": matched or None,
        "usage": _usage(completion.get("usage") or {}),
    }


def _event(kind: str, **fields: Any) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"
    )


async def message_stream(events: AsyncIterator[ChatEvent]) -> AsyncIterator[bytes]:
    """Anthropic's event stream of a chat turn's events: ``message_start``, ``ping``, per
    block ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``;
    an ``error`` event when the answer fails after it began."""
    block = -1  # the content block open now
    calls: dict[int, int] = {}  # chat tool-call index -> block index
    text_block = False  # whether the open block is text
    async with contextlib.aclosing(events) as chat:
        async for item in chat:
            if isinstance(item, Started):
                yield _event("message_start", message=_head(item.id, item.model))
                yield _event("ping")
            elif isinstance(item, TextDelta):
                if not text_block:
                    if block >= 0:
                        yield _event("content_block_stop", index=block)
                    block, text_block = block + 1, True
                    yield _event(
                        "content_block_start",
                        index=block,
                        content_block={"type": "text", "text": ""},
                    )
                yield _event(
                    "content_block_delta",
                    index=block,
                    delta={"type": "text_delta", "text": item.text},
                )
            elif isinstance(item, ToolCallDelta):
                if item.index not in calls:
                    if block >= 0:
                        yield _event("content_block_stop", index=block)
                    block, text_block = block + 1, False
                    calls[item.index] = block
                    yield _event(
                        "content_block_start",
                        index=block,
                        content_block={
                            "type": "tool_use",
                            "id": item.id or "",
                            "name": item.name or "",
                            "input": {},
                        },
                    )
                if item.arguments:
                    yield _event(
                        "content_block_delta",
                        index=calls[item.index],
                        delta={"type": "input_json_delta", "partial_json": item.arguments},
                    )
            elif isinstance(item, Completed):
                if block >= 0:
                    yield _event("content_block_stop", index=block)
                message = render_message(item.completion)
                yield _event(
                    "message_delta",
                    delta={
                        "stop_reason": message["stop_reason"],
                        "stop_sequence": message["stop_sequence"],
                    },
                    usage=message["usage"],
                )
                yield _event("message_stop")
                return
            elif isinstance(item, Failed):
                status = 503 if item.error.get("type") == "service_unavailable_error" else 500
                yield _event(
                    "error",
                    error={
                        "type": _ERROR_TYPES.get(status, "api_error"),
                        "message": item.error.get("message") or "The answer failed.",
                    },
                )
                return
