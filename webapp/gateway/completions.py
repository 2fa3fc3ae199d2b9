"""Chat completions: the gateway's hot path, independent of the web framework.

``chat_completion`` takes the request's parts (agent id, headers, body bytes) and returns a
``Reply``; the ASGI fast route (``webapp.gateway.asgi``) and the Django view both call it.
Its database work is two lane operations (``webapp.gateway.turns``): authenticate and
admit, then record the turn durably before the reply goes out. A ``stream: true`` request
hands the turn to ``webapp.gateway.streaming`` once its first tokens are in: the stream
sends them as they come and records the turn before its finish chunks and ``[DONE]``. A
stream of a caller served recently starts its engine request beside the first trip
(``webapp.gateway.early``), used only if the trip's answer asks for the very same request.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson

from rl_core.chat import ChatTemplateError, ChatTokenizer, load_chat_tokenizer, parse_tool_calls
from rl_core.ids import new_hex
from rl_core.jsonbytes import json_bytes
from webapp.accounts.auth import bearer_token
from webapp.accounts.keys import hash_key
from webapp.gateway import earlier_turns, inflight, turns
from webapp.gateway import early as early_start
from webapp.gateway.caches import CACHES
from webapp.gateway.chat_request import (
    ChatRequest,
    check_storable,
    matched_stop,
    parse_chat_request,
    storable_text,
)
from webapp.gateway.errors import GatewayError, bad_request, database_unavailable
from webapp.gateway.inference import generate, generate_stream
from webapp.gateway.lane import LaneError, lane
from webapp.gateway.prompts import Prompt, continued_choice, extend_prompt, fresh_prompt
from webapp.gateway.streaming import CompletionStream


@dataclass
class Reply:
    """An HTTP answer: a JSON body, or an SSE stream."""

    status: int
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)

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
        )


def model_id(base_model: str) -> str:
    return os.path.basename(base_model.rstrip("/")) or base_model


# Nineteen digits in a row: a number that may not fit in 64 bits (or digits in a string).
_DIGITS = bytes(1 if 0x30 <= byte <= 0x39 else 0 for byte in range(256))
_LONG_RUN = b"\x01" * 19


def _has_long_number(body: bytes) -> bool:
    return body.translate(_DIGITS).find(_LONG_RUN) >= 0  # both in C: ~5 us for 11 KB


def parse_json_body(body: bytes, content_type: str) -> object:
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type not in ("application/json", ""):
        raise bad_request(
            "Send the body as JSON (Content-Type: application/json).", code="invalid_content_type"
        )
    try:
        if _has_long_number(body):  # orjson reads integers over 64 bits as floats
            raise orjson.JSONDecodeError("", "", 0)
        parsed = orjson.loads(body or b"null")  # ~3x json's on a long session's history
    except orjson.JSONDecodeError:
        try:  # what orjson refuses or changes and json reads (NaN, lone surrogates, 2**70)
            parsed = json.loads(body or b"null")
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise bad_request(f"The body is not valid JSON: {exc}.", code="invalid_json") from None
    if not _plainly_storable(body):
        check_storable(parsed)
    return parsed


def _plainly_storable(body: bytes) -> bool:
    """True when no string parsed from ``body`` can hold a NUL or a lone surrogate, which
    ``check_storable`` looks for by walking every value. ``json.loads`` reads a body with no
    zero byte and no UTF-16/32 byte order mark as UTF-8; there a NUL or a surrogate comes
    only from a ``\\u`` escape or from the UTF-8 bytes of a surrogate (lead byte 0xED)."""
    return (
        b"\\u" not in body
        and b"\xed" not in body
        and b"\x00" not in body
        and not body.startswith((b"\xff\xfe", b"\xfe\xff"))
    )


async def _tokenizer(base_model: str) -> ChatTokenizer:
    tok = CACHES.tokenizers.get(base_model)
    if tok is None:
        try:  # the first load reads files: off the event loop
            tok = await asyncio.to_thread(load_chat_tokenizer, base_model)
        except (OSError, ValueError) as exc:
            raise GatewayError(
                503,
                f"Cannot load the tokenizer of {base_model}: {exc}",
                code="tokenizer_unavailable",
            ) from None
        CACHES.tokenizers[base_model] = tok
    return tok


async def in_lane(operation, *, durable: bool = True):
    """Run an operation in this process's lane; a batch that could not commit is a 503."""
    try:
        return await lane().run(operation, durable=durable)
    except LaneError as exc:
        raise database_unavailable(str(exc)) from None


async def chat_completion(
    *,
    agent_id: str,
    authorization: str,
    content_type: str,
    body: bytes,
    retry_count: str = "",
    idempotency_key: str = "",
    db=in_lane,
) -> Reply:
    """``POST /agents/{agent_id}/v1/chat/completions``; every failure is a Reply in OpenAI's error shape.

    ``db`` runs the database operations: this process's lane (``in_lane``), or, for Django's
    route, ``lane.in_thread``. A retry (``retry_count`` > 0, or an ``idempotency_key``) of a
    request already answered or still generating, in this web process or (with Redis) in
    another, gets that answer (``webapp.gateway.inflight``).
    """
    try:
        return await _chat_completion(
            agent_id, authorization, content_type, body, retry_count, idempotency_key, db
        )
    except GatewayError as exc:
        return Reply.error(exc)


async def _chat_completion(
    agent_id, authorization, content_type, body, retry_count, idempotency_key, db
) -> Reply:
    started = time.perf_counter()
    chat = parse_chat_request(parse_json_body(body, content_type))
    fingerprint = inflight.request_key(chat.fingerprint(), idempotency_key)
    token = bearer_token(authorization)
    is_retry = _is_retry(retry_count) or bool(idempotency_key)
    attempt = (str(agent_id), hash_key(token) if token else "", fingerprint)
    if is_retry:
        answer = await inflight.IN_FLIGHT.answer(attempt)
        if answer is not None:
            return _respond(chat, answer)
        # Still generating in another web process: ``begin`` then finds its recorded answer.
        await inflight.SHARED.settled(attempt)
    beginning = db(
        turns.begin(token=token, agent_id=agent_id, fingerprint=fingerprint, is_retry=is_retry),
        durable=False,  # an admission slot lost in an OS crash is recounted by the reconciler
    )
    caller_key = (str(agent_id), attempt[1])
    ahead = None if is_retry else early_start.early_request(chat, caller_key)
    if ahead is None:
        turn = await beginning
        early = None
    else:  # the begin trip first, then the engine request beside it
        begun = asyncio.ensure_future(beginning)
        early = early_start.EarlyStream(ahead, asyncio.ensure_future(generate_stream(**ahead)))
        try:
            turn = await begun
        except BaseException:
            begun.cancel()
            early_start.EARLY_RUNS.forget(caller_key)  # refused: none early until one is served
            await early.drop()
            raise
    if turn.replay is not None:
        if early is not None:
            await early.drop()
        return _respond(chat, turn.replay)
    if chat.stream:
        if turn.opened and turn.previous is None:  # a project key's one-turn stream
            early_start.EARLY_RUNS.remember(caller_key, turn.run)
        # A stream is not waited on by retries: its client going away aborts it, so an SDK
        # retry after a timeout finds an aborted turn and generates anew.
        answer = await _generate_or_discard(chat, turn, fingerprint, started, db, early=early)
        return answer if isinstance(answer, Reply) else _respond(chat, answer)
    # A client that may retry (the SDKs mark even their first attempt) leaves a marker for the
    # other web processes while this attempt generates (``inflight.SHARED``).
    retriable = bool(retry_count) or bool(idempotency_key)
    with inflight.IN_FLIGHT.track(attempt) as answered:
        async with inflight.SHARED.hold(attempt, retriable=retriable):
            answer = await _generate_or_discard(chat, turn, fingerprint, started, db)
        assert isinstance(answer, dict)  # only a stream answers with its SSE Reply
        answered.set_result(answer)
    return _respond(chat, answer)


async def _generate_or_discard(
    chat: ChatRequest,
    turn: turns.Turn,
    fingerprint: str,
    started: float,
    db,
    early: early_start.EarlyStream | None = None,
) -> dict | Reply:
    """``_generate_and_record``; on any failure the turn's session (a one-turn one opened for
    it) is discarded, giving its admission slot back."""
    try:
        return await _generate_and_record(chat, turn, fingerprint, started, db, early)
    except BaseException:
        if early is not None:
            await early.drop()
        if turn.opened:
            await asyncio.shield(db(turns.discard(turn=turn), durable=False))
        raise


async def _generate_and_record(
    chat: ChatRequest,
    turn: turns.Turn,
    fingerprint: str,
    started: float,
    db,
    early: early_start.EarlyStream | None = None,
) -> dict | Reply:
    """Generate and record the turn: the recorded response, or for ``stream`` the SSE Reply
    whose stream records the turn before its last events."""
    run, previous = turn.run, turn.previous
    tok = await _tokenizer(run.base_model)
    interaction_id = f"chatcmpl-{new_hex()}"
    try:
        prompt, branched = await _prompt(tok, chat, turn, db, interaction_id)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    engine_request = early_start.engine_request(
        chat, tok, run, turn.sticky_server, prompt.input_ids
    )
    sampling = engine_request["sampling_params"]
    # Which of the last turn's choices the conversation continued with; a branch continues
    # its parent's, which trajectory building reads off the messages.
    chosen = None
    if not branched:
        chosen = prompt.chosen
        if chosen is None and previous is not None:
            chosen = continued_choice(chat.messages, previous)
    record = {
        "request_hash": fingerprint,
        "messages": chat.messages,
        "tools": chat.tools,
        "sampling": sampling | {"n": chat.n, "seed": chat.seed},
        "input_ids": prompt.input_ids,
        "prefix_reused": prompt.reused,
        "previous_chosen": chosen,
        "prefix": prompt.prefix,
    }
    if chat.stream:
        started_early = await early.take(engine_request) if early is not None else None
        # The stream owns the turn from here: it records it, or discards it on an error.
        stream = CompletionStream(
            chat=chat,
            tok=tok,
            generation=started_early or await generate_stream(**engine_request),
            interaction_id=interaction_id,
            model=model_id(run.base_model),
            record=record,
            started=started,
            turn=turn,
            db=db,
        )
        return Reply.sse(stream.events())
    generation = await generate(**engine_request)
    response, outputs = _completion(
        chat, tok, run.base_model, interaction_id, prompt.input_ids, generation.results
    )
    recorded = await db(
        turns.record(
            turn=turn,
            interaction_id=interaction_id,
            outputs=outputs,
            response=response,
            server_url=generation.server_url,
            latency_ms=(time.perf_counter() - started) * 1000,
            **record,
        )
    )
    turns.remember(turn, recorded)  # committed: the session's next turn may start from it
    return recorded.response


async def _prompt(
    tok: ChatTokenizer, chat: ChatRequest, turn: turns.Turn, db, interaction_id: str
) -> tuple[Prompt, bool]:
    """The prompt's ids: the last turn's exact tokens continued, or, for a request that does not
    continue the last turn, those of the earlier turn it branches from (``webapp.gateway.branches``:
    a parallel sub-agent, a fork), or a fresh render. ``True`` when a branch parent was used.
    The common path, continuing the last turn, costs no extra statement."""
    last, tools = turn.previous, chat.rendered_tools
    if last is not None:
        extended = extend_prompt(tok, chat.messages, tools, last, interaction_id)
        if extended is not None:
            return extended, False
        if turn.caller.session_turns > 1:
            parent = await db(
                earlier_turns.branch_parent(
                    session_id=turn.session_id,
                    last_turn=turn.caller.session_turns - 1,
                    messages=chat.messages,
                    tools=tools,
                ),
                durable=False,
            )
            extended = (
                extend_prompt(tok, chat.messages, tools, parent, interaction_id) if parent else None
            )
            if extended is not None:
                return extended, True
    return fresh_prompt(tok, chat.messages, tools), False


def _is_retry(retry_count: str) -> bool:
    try:
        return int(retry_count or "0") > 0
    except ValueError:
        return False


def _respond(chat: ChatRequest, response: dict) -> Reply:
    if not chat.stream:
        return Reply.json(response)
    return Reply.sse(_sse(chat, response))


def _completion(
    chat: ChatRequest, tok, base_model: str, interaction_id: str, input_ids: list[int], results
) -> tuple[dict, list[dict]]:
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
