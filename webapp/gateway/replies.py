"""What the gateway answers: an HTTP ``Reply`` (a JSON body or an SSE stream), and a chat turn's
answer in OpenAI's shapes.

``completion`` builds a non-streamed turn's ``chat.completion`` (and the outputs recorded with
it) from the engine's results; ``respond`` sends a recorded one, as JSON or, to a retry of a
streamed turn, replayed as SSE chunks. A live stream's chunks are ``webapp.gateway.streaming``'s.
Generated text is recorded and returned as ``storable_text`` makes it.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from rl_core.chat import parse_tool_calls
from rl_core.jsonbytes import json_bytes
from webapp.gateway.chat_request import ChatRequest
from webapp.gateway.errors import GatewayError


@dataclass
class Reply:
    """An HTTP answer: a JSON body, or an SSE stream."""

    status: int
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    reason: str = ""  # an error's code (a 429's reason in the metrics, webapp.metrics)

    @classmethod
    def json(cls, payload: dict, status: int = 200) -> Reply:
        return cls(status, json_bytes(payload), headers={"Content-Type": "application/json"})

    @classmethod
    def sse(cls, stream: AsyncIterator[bytes]) -> Reply:
        """A 200 streaming ``stream`` as server-sent events, unbuffered by proxies."""
        return cls(
            200,
            stream=stream,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )

    @classmethod
    def error(cls, exc: GatewayError) -> Reply:
        status, payload, headers = exc.payload()
        return cls(
            status,
            orjson.dumps(payload),
            headers={"Content-Type": "application/json", **headers},
            reason=exc.code or "",
        )


def model_id(base_model: str) -> str:
    return os.path.basename(base_model.rstrip("/")) or base_model


def storable_text(text: str) -> str:
    """Generated text as recorded and returned: a generated NUL becomes U+FFFD, as undecodable bytes do."""
    return text.replace("\x00", "\ufffd")


def matched_stop(text: str, stops: list[str], engine_said: Any = None) -> str | None:
    """The stop string that ended ``text`` (SGLang's ``matched_stop``): the engine's word for
    it when it names one of ``stops``, else the one found first in the text (the shortest of
    those starting there, which the engine meets first), or None."""
    if isinstance(engine_said, str) and engine_said in stops:
        return engine_said
    found = [(text.find(s), len(s), s) for s in stops if s and s in text]
    return min(found)[2] if found else None


def respond(chat: ChatRequest, response: dict) -> Reply:
    """A recorded completion as the request asked for it: JSON, or replayed as SSE chunks."""
    if not chat.stream:
        return Reply.json(response)
    return Reply.sse(_sse(chat, response))


def completion(
    chat: ChatRequest, tok, base_model: str, interaction_id: str, input_ids: list[int], results
) -> tuple[dict, list[dict]]:
    """A non-streamed turn's ``chat.completion`` from the engine's ``results``, and the outputs
    recorded with it (per choice: ids, logprobs, versions, finish reason, text)."""
    choices, outputs = [], []
    completion_tokens = 0
    for index, result in enumerate(results):
        decoded = storable_text(tok.decode(result.output_ids))
        text = _trim_stop(decoded, chat.stop)
        content, tool_calls = parse_tool_calls(text) if chat.rendered_tools else (text, [])
        finish = (
            "tool_calls"
            if tool_calls
            else ("length" if result.finish_reason in ("length", "abort") else "stop")
        )
        message = {"role": "assistant", "content": content if content or not tool_calls else None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {
            "index": index,
            "message": message,
            "finish_reason": finish,
            # As SGLang's: the stop string that ended the answer (Anthropic's stop_sequence)
            "matched_stop": matched_stop(decoded, chat.stop, result.matched_stop)
            if finish == "stop"
            else None,
            "logprobs": _logprobs(chat, tok, result) if chat.logprobs else None,
        }
        choices.append(choice)
        outputs.append(
            {
                "output_ids": result.output_ids,
                "logprobs": result.output_logprobs,
                "versions": result.versions,
                "finish_reason": result.finish_reason,
                "text": text,
            }
        )
        completion_tokens += len(result.output_ids)
    response = {
        "id": interaction_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_id(base_model),
        "system_fingerprint": f"steep-v{max((max(r.versions, default=0) for r in results), default=0)}",
        "choices": choices,
        "usage": {
            "prompt_tokens": len(input_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(input_ids) + completion_tokens,
        },
    }
    return response, outputs


def _trim_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return text[:cut] if cut >= 0 else text


def _logprobs(chat: ChatRequest, tok, result) -> dict:
    content = []
    for position, (token_id, logprob) in enumerate(
        zip(result.output_ids, result.output_logprobs, strict=True)
    ):
        text = tok.token_text(token_id)
        entry = {
            "token": storable_text(text),
            "logprob": logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [],
        }
        if chat.top_logprobs and result.top_logprobs and position < len(result.top_logprobs):
            for top_lp, top_id in result.top_logprobs[position][: chat.top_logprobs]:
                top_text = tok.token_text(top_id)
                entry["top_logprobs"].append(
                    {
                        "token": storable_text(top_text),
                        "logprob": top_lp,
                        "bytes": list(top_text.encode()),
                    }
                )
        content.append(entry)
    return {"content": content, "refusal": None}


async def _sse(chat: ChatRequest, response: dict):
    """OpenAI's chunk stream replaying a recorded completion (an SDK retry of a streamed turn):
    role, content pieces, finish, usage, [DONE]."""

    def chunk(choices: list[dict], usage=None) -> bytes:
        body = {
            "id": response["id"],
            "object": "chat.completion.chunk",
            "created": response["created"],
            "model": response["model"],
            "system_fingerprint": response.get("system_fingerprint"),
            "choices": choices,
        }
        if chat.include_usage:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    for choice in response["choices"]:
        index, message = choice["index"], choice["message"]
        yield chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        logprob_items = (choice.get("logprobs") or {}).get("content") or []
        if logprob_items:
            # One chunk: the content as answered (a token's text may be markup or the stop
            # token, which never go out as content) with the recorded entries.
            yield chunk(
                [
                    {
                        "index": index,
                        "delta": {"content": message.get("content") or ""},
                        "logprobs": {"content": logprob_items, "refusal": None},
                        "finish_reason": None,
                    }
                ]
            )
        elif message.get("content"):
            for piece in _pieces(message["content"]):
                yield chunk(
                    [
                        {
                            "index": index,
                            "delta": {"content": piece},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
        for position, call in enumerate(message.get("tool_calls") or []):
            yield chunk(
                [
                    {
                        "index": index,
                        "delta": {"tool_calls": [{"index": position, **call}]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        yield chunk(
            [
                {
                    "index": index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": choice["finish_reason"],
                }
            ]
        )
    if chat.include_usage:
        yield chunk([], usage=response["usage"])
    yield b"data: [DONE]\n\n"


def _pieces(text: str, size: int = 16):
    for start in range(0, len(text), size):
        yield text[start : start + size]
