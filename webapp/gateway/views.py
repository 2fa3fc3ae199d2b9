"""The OpenAI-compatible gateway: ``{SITE_URL}/agents/{agent_id}/v1/...``.

Views parse, call services (through ``sync_to_async``) and the inference client,
and answer in OpenAI's shapes. Every error is a GatewayError rendered in
OpenAI's error shape; bad input never reaches the database.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from rl_core.chat import ChatTemplateError, load_chat_tokenizer, parse_tool_calls
from webapp import ratelimit
from webapp.accounts.auth import bearer_token
from webapp.accounts.keys import hash_key
from webapp.gateway import selectors, services
from webapp.gateway.errors import GatewayError, bad_request
from webapp.gateway.inference import generate
from webapp.gateway.prompts import build_prompt, continued_choice
from webapp.gateway.requests import (
    ChatRequest,
    check_storable,
    parse_chat_request,
    storable_text,
)
from webapp.middleware import too_large_response


def _dbcall(fn):
    # ORM calls leave the event loop for a worker thread; not thread_sensitive, so
    # concurrent requests do not queue behind one shared thread.
    return sync_to_async(fn, thread_sensitive=False)


def _token(request: HttpRequest) -> str | None:
    return bearer_token(request.headers.get("Authorization", ""))


def _authenticate(*, token: str | None, agent_id: str) -> services.GatewayAuth:
    """The key's agent (401/404 otherwise), then one request counted against the key's rate
    limit. Limiting after authentication counts only real keys; limiting before the run's
    state is checked means a client hammering a stopped run is slowed down too."""
    auth = services.gateway_authenticate(token=token, agent_id=agent_id)
    limit = settings.RATE_LIMIT_GATEWAY_PER_MIN
    limited = ratelimit.hit(f"gw:{hash_key(token)[:32]}", limit=limit) if limit > 0 else None
    if limited is not None:
        raise GatewayError(
            429,
            f"Rate limit of {limit} requests per minute exceeded for this key; retry after {limited.retry_after} s.",
            code="rate_limit_exceeded",
            retry_after=limited.retry_after,
        )
    return auth


def _json_body(request: HttpRequest) -> object:
    if request.content_type not in ("application/json", "", None):
        raise bad_request(
            "Send the body as JSON (Content-Type: application/json).", code="invalid_content_type"
        )
    try:
        body = json.loads(request.body or b"null")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise bad_request(f"The body is not valid JSON: {exc}.", code="invalid_json") from None
    check_storable(body)
    return body


def _gateway_view(methods: tuple[str, ...]):
    def wrap(view):
        @csrf_exempt
        async def handler(request, agent_id, *args, **kwargs):
            if request.method not in methods:
                return GatewayError(
                    405, f"Use {' or '.join(methods)} on this endpoint.", code="method_not_allowed"
                ).response()
            try:
                return await view(request, agent_id, *args, **kwargs)
            except GatewayError as exc:
                return exc.response()
            except RequestDataTooBig:
                # A body without Content-Length (chunked) passes the middleware's check;
                # Django refuses it when read.
                return too_large_response(settings.DATA_UPLOAD_MAX_MEMORY_SIZE, openai_shape=True)

        handler.__name__ = view.__name__
        return handler

    return wrap


def _model_id(run) -> str:
    return os.path.basename(run.base_model.rstrip("/")) or run.base_model


@_gateway_view(("GET",))
async def models(request, agent_id):
    auth = await _dbcall(_authenticate)(token=_token(request), agent_id=agent_id)
    run = auth.agent.run
    data = []
    if run is not None:
        data.append(
            {
                "id": _model_id(run),
                "object": "model",
                "created": int(run.created_at.timestamp()),
                "owned_by": "steep",
                "root": run.base_model,
                "weight_version": run.weight_version,
                "run_id": str(run.id),
            }
        )
    return JsonResponse({"object": "list", "data": data})


# --- Chat completions ----------------------------------------------------------------------


@_gateway_view(("POST",))
async def chat_completions(request, agent_id):
    started = time.perf_counter()
    chat = parse_chat_request(_json_body(request))
    auth = await _dbcall(_authenticate)(token=_token(request), agent_id=agent_id)
    run = await _dbcall(services.serving_run)(auth.agent)
    try:
        tok = await _dbcall(load_chat_tokenizer)(run.base_model)
    except (OSError, ValueError) as exc:
        raise GatewayError(
            503,
            f"Cannot load the tokenizer of {run.base_model}: {exc}",
            code="tokenizer_unavailable",
        ) from None

    fingerprint = chat.fingerprint()
    session = auth.session
    previous = None
    if session is not None:
        session = await _dbcall(services.session_require_open)(session)
        last = await _dbcall(selectors.last_interaction)(session=session)
        if last is not None and last.request_hash == fingerprint:
            return _respond(
                chat, last.response
            )  # an SDK retry of the last turn: same answer, nothing recorded twice
        previous = await _dbcall(selectors.previous_turn)(session=session)
    elif _is_retry(request):
        replay = await _dbcall(selectors.recent_one_turn_replay)(
            agent=auth.agent, request_hash=fingerprint
        )
        if replay is not None:
            return _respond(chat, replay.response)

    try:
        prompt = build_prompt(tok, chat.messages, chat.rendered_tools, previous)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    max_new = min(chat.max_tokens, settings.GATEWAY_MAX_NEW_TOKENS)
    sampling = chat.sampling_params(max_new_tokens=max_new, stop_token_ids=tok.eos_token_ids)

    opened = None
    if session is None:
        session, _ = await _dbcall(services.session_open)(agent=auth.agent, run=run, one_turn=True)
        opened = session
    try:
        generation = await generate(
            run_id=run.id,
            sticky=session.server_url,
            input_ids=prompt.input_ids,
            sampling_params=sampling,
            n=chat.n,
            seed=chat.seed,
            top_logprobs=chat.top_logprobs,
        )
    except BaseException:
        if opened is not None:
            await _dbcall(services.session_discard)(session=opened)
        raise

    interaction_id = f"chatcmpl-{uuid.uuid4().hex}"
    response, outputs = _completion(
        chat, tok, run, interaction_id, prompt.input_ids, generation.results
    )
    chosen = (
        prompt.chosen
        if prompt.chosen is not None
        else (continued_choice(chat.messages, previous) if previous else None)
    )
    recorded = await _dbcall(services.interaction_record)(
        session=session,
        interaction_id=interaction_id,
        request_hash=fingerprint,
        messages=chat.messages,
        tools=chat.tools,
        sampling=sampling | {"n": chat.n, "seed": chat.seed},
        input_ids=prompt.input_ids,
        prefix_reused=prompt.reused,
        outputs=outputs,
        response=response,
        server_url=generation.server_url,
        latency_ms=(time.perf_counter() - started) * 1000,
        previous_chosen=chosen,
    )
    return _respond(chat, recorded.response)


def _is_retry(request: HttpRequest) -> bool:
    try:
        return int(request.headers.get("X-Stainless-Retry-Count", "0")) > 0
    except ValueError:
        return False


def _completion(
    chat: ChatRequest, tok, run, interaction_id: str, input_ids: list[int], results
) -> tuple[dict, list[dict]]:
    choices, outputs = [], []
    completion_tokens = 0
    for index, result in enumerate(results):
        text = _trim_stop(storable_text(tok.decode(result.output_ids)), chat.stop)
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
        "model": _model_id(run),
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


def _respond(chat: ChatRequest, response: dict) -> HttpResponse:
    if not chat.stream:
        return JsonResponse(response)
    return StreamingHttpResponse(
        _sse(chat, response),
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse(chat: ChatRequest, response: dict):
    """OpenAI's chunk stream for a recorded completion: role, content pieces, finish, usage, [DONE]."""

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
        return f"data: {json.dumps(body)}\n\n".encode()

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
            for item in logprob_items:
                yield chunk(
                    [
                        {
                            "index": index,
                            "delta": {"content": item["token"]},
                            "logprobs": {"content": [item], "refusal": None},
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


# --- RL protocol ---------------------------------------------------------------------------


@_gateway_view(("POST",))
async def start_session(request, agent_id):
    body = _json_body(request) if request.body else {}
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object (or empty).", code="invalid_json")
    task_id, metadata = body.get("task_id", ""), body.get("metadata") or {}
    if task_id is None:
        task_id = ""
    if not isinstance(task_id, str | int):
        raise bad_request("'task_id' must be a string.", param="task_id", code="invalid_type")
    if not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object.", param="metadata", code="invalid_type")
    token = _token(request)
    auth = await _dbcall(_authenticate)(token=token, agent_id=agent_id)
    run = await _dbcall(services.serving_run)(auth.agent)
    replaces = auth.session if auth.session is not None and auth.session.status == "open" else None
    if auth.session is not None and replaces is None:
        expired = auth.session.status == "expired"  # 410 like every other call with this key
        raise GatewayError(
            410 if expired else 409,
            f"This session key's session has {'expired' if expired else 'ended'}; start new sessions with the project key.",
            code="session_expired" if expired else "session_ended",
        )
    session, plaintext = await _dbcall(services.session_open)(
        agent=auth.agent,
        run=run,
        one_turn=False,
        task_id=str(task_id),
        metadata=metadata,
        replaces=replaces,
    )
    return JsonResponse({"session_id": str(session.id), "api_key": plaintext or token}, status=201)


@_gateway_view(("POST",))
async def set_reward(request, agent_id):
    body = _json_body(request)
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object with 'reward'.", code="invalid_json")
    reward = body.get("reward")
    if reward is None:
        raise bad_request(
            "'reward' is required (a number).", param="reward", code="missing_required_parameter"
        )
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise bad_request("'reward' must be a finite number.", param="reward", code="invalid_type")
    interaction_id = body.get("interaction_id")
    if interaction_id is not None and not isinstance(interaction_id, str):
        raise bad_request(
            "'interaction_id' must be a string.", param="interaction_id", code="invalid_type"
        )
    auth = await _dbcall(_authenticate)(token=_token(request), agent_id=agent_id)
    interaction = await _dbcall(services.reward_set)(
        session=auth.session, agent=auth.agent, reward=float(reward), interaction_id=interaction_id
    )
    return JsonResponse(
        {
            "interaction_id": interaction.id,
            "session_id": str(interaction.session_id),
            "reward": interaction.reward,
        }
    )


@_gateway_view(("POST",))
async def end_session(request, agent_id):
    auth = await _dbcall(_authenticate)(token=_token(request), agent_id=agent_id)
    if auth.session is None:
        raise bad_request(
            "end_session needs the session key returned by /rl/start_session as the bearer token.",
            code="session_key_required",
        )
    session = await _dbcall(services.session_end)(session=auth.session)
    return JsonResponse(
        {
            "session_id": str(session.id),
            "interaction_count": session.interaction_count,
            "trajectory": session.trajectory,
        }
    )
