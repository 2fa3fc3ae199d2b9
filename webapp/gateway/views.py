"""The OpenAI-compatible gateway: ``{SITE_URL}/agents/{agent_id}/v1/...``.

Chat completions are ``webapp.gateway.completions`` (framework-free, also served by the
ASGI fast route); the other endpoints parse, call services (through ``sync_to_async``)
and answer in OpenAI's shapes. Every error is a GatewayError rendered in OpenAI's error
shape; bad input never reaches the database.
"""

from __future__ import annotations

import math

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from webapp.accounts.auth import bearer_token
from webapp.gateway import services, turns
from webapp.gateway.completions import chat_completion, model_id, parse_json_body
from webapp.gateway.errors import GatewayError, bad_request
from webapp.gateway.lane import in_thread
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
    turns.rate_limit(auth.caller)
    return auth


def _json_body(request: HttpRequest) -> object:
    return parse_json_body(request.body, request.headers.get("Content-Type", ""))


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


@_gateway_view(("GET",))
async def models(request, agent_id):
    caller = await in_thread(_models_caller(_token(request), agent_id))
    run = caller.run
    data = []
    if run is not None:
        data.append(
            {
                "id": model_id(run.base_model),
                "object": "model",
                "created": int(run.created_at.timestamp()),
                "owned_by": "steep",
                "root": run.base_model,
                "weight_version": run.weight_version,
                "run_id": str(run.id),
            }
        )
    return JsonResponse({"object": "list", "data": data})


def _models_caller(token, agent_id):
    def operation(cursor) -> turns.Caller:
        caller = turns.authenticate(cursor, token=token, agent_id=agent_id)
        turns.rate_limit(caller)
        return caller

    return operation


@_gateway_view(("POST",))
async def chat_completions(request, agent_id):
    """The Django route to ``completions.chat_completion`` (under ASGI, ``webapp.gateway.asgi``
    answers this path before Django sees it)."""
    reply = await chat_completion(
        agent_id=agent_id,
        authorization=request.headers.get("Authorization", ""),
        content_type=request.headers.get("Content-Type", ""),
        body=request.body,
        retry_count=request.headers.get("X-Stainless-Retry-Count", ""),
        db=in_thread,
    )
    if reply.stream is not None:
        return StreamingHttpResponse(reply.stream, status=reply.status, headers=reply.headers)
    return HttpResponse(reply.body, status=reply.status, headers=reply.headers)


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
    run = await _dbcall(services.serving_run)(auth)
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
