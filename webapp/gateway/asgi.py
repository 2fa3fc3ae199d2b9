"""The gateway's ASGI fast route: an agent's calls answered without Django's request stack.

Agents call ``POST /agents/{agent_id}/v1/chat/completions`` (or its translations
``/responses`` and Anthropic's ``/messages``) and the RL protocol's ``/rl/start_session``,
``/rl/set_reward`` and ``/rl/end_session`` far more often than anything else, and Django's request/response cycle and middleware cost more CPU than
their own work (docs/benchmarks/gateway.md). ``fast_route(django_app)`` wraps the Django
application: those paths go straight to ``completions.chat_completion``,
``responses_api.create_response``, ``anthropic_api.create_message`` and
``webapp.gateway.rl``; every other request, and any that needs Django's handling (a host
not in ``ALLOWED_HOSTS``, plain HTTP when ``SECURE_SSL_REDIRECT`` is on), goes to Django
unchanged. Django's views call the same functions, so both routes give the same answers.

What the middleware did for these requests is done here too: the request id
(``X-Request-ID``, the request's log line), the body limit (413 in OpenAI's shape, by
``Content-Length`` or while reading), and the security headers JSON answers carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time

from django.conf import settings
from django.http.request import split_domain_port, validate_host

from webapp import observability
from webapp.gateway import rl
from webapp.gateway.anthropic_api import anthropic_error, create_message
from webapp.gateway.completions import chat_completion
from webapp.gateway.errors import GatewayError, database_unavailable
from webapp.gateway.lane import DB_ERRORS
from webapp.gateway.replies import Reply
from webapp.gateway.responses_api import create_response
from webapp.metrics import instruments
from webapp.middleware import too_large_body

logger = logging.getLogger(__name__)

ROUTE = re.compile(
    r"/agents/([^/]+)/v1/"
    r"(chat/completions|responses|messages|rl/start_session|rl/set_reward|rl/end_session)"
)


def _endpoint(function, **header_arguments: str):
    """``function`` (an agent endpoint taking the request's parts) called with the agent id, the
    bearer, the content type, the body, and each of ``header_arguments`` (argument → header)."""

    async def answer(agent_id: str, headers: dict[str, str], body: bytes) -> Reply:
        return await function(
            agent_id=agent_id,
            authorization=headers.get("authorization", ""),
            content_type=headers.get("content-type", ""),
            body=body,
            **{name: headers.get(header, "") for name, header in header_arguments.items()},
        )

    return answer


ENDPOINTS = {
    "chat/completions": _endpoint(
        chat_completion, retry_count="x-stainless-retry-count", idempotency_key="idempotency-key"
    ),
    "responses": _endpoint(
        create_response, retry_count="x-stainless-retry-count", idempotency_key="idempotency-key"
    ),
    "messages": _endpoint(
        create_message,
        api_key="x-api-key",
        retry_count="x-stainless-retry-count",
        idempotency_key="idempotency-key",
    ),
    "rl/start_session": _endpoint(rl.start_session),
    "rl/set_reward": _endpoint(rl.set_reward),
    "rl/end_session": _endpoint(rl.end_session),
}
# Endpoints whose refusals (a wrong method, a body over the limit) are not in OpenAI's shape.
REFUSAL_SHAPES = {"messages": anthropic_error}


def fast_route(django_app):
    """An ASGI app serving an agent's calls itself and everything else through ``django_app``."""

    async def app(scope, receive, send):
        if scope["type"] == "http":
            match = ROUTE.fullmatch(scope["path"])
            if match is not None:
                headers = _headers(scope)
                if _ours(scope, headers):
                    name = match.group(2)
                    await _serve(scope, receive, send, name, match.group(1), headers)
                    return
        await django_app(scope, receive, send)

    return app


def _headers(scope) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


def _secure(scope, headers: dict[str, str]) -> bool:
    proxy = settings.SECURE_PROXY_SSL_HEADER
    if proxy:  # as Django's is_secure: the proxy's header when present, else the scheme
        value = headers.get(proxy[0].removeprefix("HTTP_").replace("_", "-").lower())
        if value is not None:
            return value.split(",")[0].strip() == proxy[1]
    return scope.get("scheme") == "https"


def _ours(scope, headers: dict[str, str]) -> bool:
    """False for requests Django must answer: a disallowed host, or plain HTTP to be redirected."""
    domain, _ = split_domain_port(headers.get("host", ""))
    allowed = settings.ALLOWED_HOSTS or (
        [".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else []
    )
    if not domain or not validate_host(domain, allowed):
        return False
    return not settings.SECURE_SSL_REDIRECT or _secure(scope, headers)


async def _serve(scope, receive, send, name: str, agent_id: str, headers: dict[str, str]) -> None:
    started = time.perf_counter()
    request_id = observability.request_id_for(headers.get("x-request-id"))
    observability.request_id_var.set(request_id)
    if scope["method"] != "POST":
        reply = _refusal(
            name,
            Reply.error(GatewayError(405, "Use POST on this endpoint.", code="method_not_allowed")),
        )
    else:
        try:
            body = await _read_body(receive, headers)
        except _Disconnected:
            return
        if body is None:
            reply = _refusal(name, _too_large())
        else:
            try:
                reply = await ENDPOINTS[name](agent_id, headers, body)
            except DB_ERRORS as exc:  # a read outside the lane (the lane answers its own 503)
                logger.error("gateway: database unavailable: %r", exc)
                reply = _refusal(name, Reply.error(database_unavailable()))
    await _send(send, receive, reply, request_id, _secure(scope, headers))
    observability.log_request(scope["method"], scope["path"], reply.status, started)
    instruments.gateway_request(name, reply.status, reply.reason, started)


async def _read_body(receive, headers: dict[str, str]) -> bytes | None:
    """The request body, or None when it is over MAX_REQUEST_BYTES (announced or as read)."""
    limit = settings.MAX_REQUEST_BYTES
    try:
        if int(headers.get("content-length") or 0) > limit:
            return None
    except ValueError:
        pass
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


class _Disconnected(Exception):
    """The client went away before its request body arrived."""


def _refusal(name: str, reply: Reply) -> Reply:
    """A refusal of this module's own (405, 413) in endpoint ``name``'s error shape."""
    shape = REFUSAL_SHAPES.get(name)
    return reply if shape is None else shape(reply)


def _too_large() -> Reply:
    return Reply.json(too_large_body(settings.MAX_REQUEST_BYTES, openai_shape=True), status=413)


def _response_headers(reply: Reply, request_id: str, secure: bool) -> list[tuple[bytes, bytes]]:
    headers = {
        **reply.headers,
        "X-Request-ID": request_id,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "same-origin",
        "Cross-Origin-Opener-Policy": "same-origin",
    }
    if secure and settings.SECURE_HSTS_SECONDS:
        hsts = f"max-age={settings.SECURE_HSTS_SECONDS}"
        if settings.SECURE_HSTS_INCLUDE_SUBDOMAINS:
            hsts += "; includeSubDomains"
        if settings.SECURE_HSTS_PRELOAD:
            hsts += "; preload"
        headers["Strict-Transport-Security"] = hsts
    if reply.stream is None:
        headers["Content-Length"] = str(len(reply.body))
    return [
        (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()
    ]


async def _send(send, receive, reply: Reply, request_id: str, secure: bool) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": reply.status,
            "headers": _response_headers(reply, request_id, secure),
        }
    )
    if reply.stream is None:
        await send({"type": "http.response.body", "body": reply.body})
        return
    await _send_stream(send, receive, reply.stream)


async def _send_stream(send, receive, stream) -> None:
    """Send an SSE body while watching for the client to go away; then the stream is cancelled
    (and so learns it was abandoned: a streamed completion aborts its generation)."""
    sending = asyncio.ensure_future(_send_chunks(send, stream))
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not sending.done():
            sending.cancel()
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await sending


async def _send_chunks(send, stream) -> None:
    # A send that fails (the client went away) closes the stream, which then cleans up.
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
