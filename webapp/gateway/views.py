"""The OpenAI-compatible gateway: ``{SITE_URL}/agents/{agent_id}/v1/...``.

Chat completions (``webapp.gateway.completions``), the Responses and Anthropic Messages
APIs built on them (``responses_api``, ``anthropic_api``) and the RL protocol
(``webapp.gateway.rl``) are framework-free and also served by the ASGI fast route; these
views hand them Django's request and run their database work through ``lane.in_thread``.
Every error is a GatewayError rendered in OpenAI's error shape; bad input never reaches
the database. Every answer is counted in the gateway's metrics (``webapp.metrics``), as the
fast route counts its own.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from webapp.accounts.auth import bearer_token
from webapp.gateway import rl, roles, turns
from webapp.gateway.anthropic_api import anthropic_error, create_message
from webapp.gateway.completions import chat_completion
from webapp.gateway.errors import GatewayError
from webapp.gateway.lane import in_thread
from webapp.gateway.replies import Reply, model_id
from webapp.gateway.responses_api import create_response
from webapp.metrics import instruments
from webapp.middleware import too_large_body


def _token(request: HttpRequest) -> str | None:
    return bearer_token(request.headers.get("Authorization", ""))


def _gateway_view(endpoint: str, methods: tuple[str, ...], shape=None):
    """A view answering a Reply, counted as ``endpoint`` in the metrics. ``shape``: turns an
    error Reply in OpenAI's shape into the endpoint's own."""

    def refuse(reply: Reply) -> Reply:
        return reply if shape is None else shape(reply)

    def wrap(view):
        @csrf_exempt
        async def handler(request, agent_id, *args, **kwargs):
            started = time.perf_counter()
            if request.method not in methods:
                reply = refuse(
                    Reply.error(
                        GatewayError(
                            405,
                            f"Use {' or '.join(methods)} on this endpoint.",
                            code="method_not_allowed",
                        )
                    )
                )
            else:
                try:
                    reply = await view(request, agent_id, *args, **kwargs)
                except GatewayError as exc:
                    reply = refuse(Reply.error(exc))
                except RequestDataTooBig:
                    # A body without Content-Length (chunked) passes the middleware's check;
                    # Django refuses it when read.
                    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
                    reply = refuse(Reply.json(too_large_body(limit, openai_shape=True), status=413))
            instruments.gateway_request(endpoint, reply.status, reply.reason, started)
            return _response(reply)

        handler.__name__ = view.__name__
        return handler

    return wrap


@_gateway_view("models", ("GET",))
async def models(request, agent_id) -> Reply:
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
        # A multi-agent run: one model id per role, as requests name them (gateway.roles).
        run_roles = roles.run_roles(run.config)
        if run_roles:
            base = data[0]
            data = [base | {"id": name} for name in roles.role_models(run_roles)] + [base]
    return Reply.json({"object": "list", "data": data})


def _models_caller(token, agent_id):
    def operation(cursor) -> turns.Caller:
        return turns.identify(cursor, token=token, agent_id=agent_id)

    return operation


def _agent_view(name: str, endpoint, shape=None, **header_arguments: str):
    """A Django view for the agent endpoint ``name`` (``completions.chat_completion``, the
    ``rl`` functions, the Responses and Messages APIs; under ASGI, ``webapp.gateway.asgi``
    answers these paths before Django sees them), its database work run through
    ``lane.in_thread``."""

    @_gateway_view(name, ("POST",), shape)
    async def view(request, agent_id) -> Reply:
        return await endpoint(
            agent_id=agent_id,
            authorization=request.headers.get("Authorization", ""),
            content_type=request.headers.get("Content-Type", ""),
            body=request.body,
            db=in_thread,
            **{arg: request.headers.get(header, "") for arg, header in header_arguments.items()},
        )

    view.__name__ = endpoint.__name__
    return view


chat_completions = _agent_view(
    "chat/completions",
    chat_completion,
    retry_count="X-Stainless-Retry-Count",
    idempotency_key="Idempotency-Key",
)
responses = _agent_view(
    "responses",
    create_response,
    retry_count="X-Stainless-Retry-Count",
    idempotency_key="Idempotency-Key",
)
messages = _agent_view(
    "messages",
    create_message,
    anthropic_error,
    api_key="X-Api-Key",
    retry_count="X-Stainless-Retry-Count",
    idempotency_key="Idempotency-Key",
)
start_session = _agent_view("rl/start_session", rl.start_session)
set_reward = _agent_view("rl/set_reward", rl.set_reward)
end_session = _agent_view("rl/end_session", rl.end_session)


def _response(reply: Reply) -> HttpResponse:
    if reply.stream is not None:
        return StreamingHttpResponse(reply.stream, status=reply.status, headers=reply.headers)
    return HttpResponse(reply.body, status=reply.status, headers=reply.headers)
