"""A chat turn's trace (``rl_core.tracing``): its spans and their attributes.

One trace per turn, through ``/chat/completions`` or the APIs translated onto it (``/responses``,
``/messages``), its phases in order as children of the root::

    steep.turn           SERVER  the whole turn; a stream's ends with its last chunk
      steep.turn.admit           authentication and admission (``turns.begin``)
      steep.turn.render          the prompt (``prompts.turn_prompt``)
      steep.turn.engine  CLIENT  the engine call; a stream's ends with its last token
      steep.turn.record          the turn recorded and committed (``turns.record``)

Every span has ``steep.request_id`` (the request's ``X-Request-ID``, as in the logs).
Attributes follow OpenTelemetry's GenAI semantic conventions where they fit
(``gen_ai.operation.name``, ``gen_ai.request.*``, ``gen_ai.usage.input_tokens`` and
``output_tokens`` as the response's ``usage`` counts them, ``gen_ai.response.id``: the
interaction id, ``gen_ai.conversation.id``: the session); Steep's own are ``steep.*``.
Call sites test ``tracing.ON`` (or the trace they hold) first: with traces off nothing here runs.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from rl_core.tracing import Trace, start
from webapp.gateway.errors import GatewayError
from webapp.gateway.replies import Reply, model_id
from webapp.observability import request_id_var


def turn_trace(agent_id) -> Trace | None:
    """The root span of a turn, begun as the request arrives (None: the sampler dropped it)."""
    return start(
        "steep.turn",
        {"steep.request_id": request_id_var.get()},
        {"gen_ai.operation.name": "chat", "gen_ai.agent.id": str(agent_id)},
        kind="SERVER",
    )


def admitted(trace: Trace, turn) -> None:
    """End ``steep.turn.admit``: who the turn is for."""
    trace.note(
        {
            "gen_ai.conversation.id": str(turn.session_id),
            "gen_ai.request.model": model_id(turn.run.base_model),
            "steep.run_id": str(turn.run.id),
        }
    )
    trace.end({"steep.session.opened": turn.opened, "steep.replay": turn.replay is not None})


def rendered(trace: Trace, prompt) -> None:
    """End ``steep.turn.render``."""
    trace.end({"steep.prompt.tokens": len(prompt.input_ids), "steep.prompt.reused": prompt.reused})


def engine_begins(trace: Trace, chat, run, request: dict) -> None:
    """Begin ``steep.turn.engine`` for ``request`` (``inference.engine_request``)."""
    trace.begin(
        "steep.turn.engine",
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": model_id(run.base_model),
            "gen_ai.request.max_tokens": request["sampling_params"].get("max_new_tokens"),
            "gen_ai.request.temperature": chat.temperature,
            "gen_ai.request.top_p": chat.top_p,
            "gen_ai.request.seed": chat.seed,
            "gen_ai.request.choice.count": chat.n,
            "gen_ai.request.stream": chat.stream,
            "gen_ai.usage.input_tokens": len(request["input_ids"]),
            "steep.weight_version": run.weight_version,
        },
        kind="CLIENT",
    )


def first_chunk(trace: Trace, *, early: bool) -> None:
    """A stream's first chunk arrived: its time since the engine span began; or, ``early``, the
    stream began beside admission (``webapp.gateway.early``), before the span did."""
    if early:
        trace.set({"steep.engine.early": True})
    else:
        trace.set({"gen_ai.response.time_to_first_chunk": trace.elapsed()})


def engine_ends(trace: Trace, server_url: str, outputs: list[tuple[int, str | None]]) -> None:
    """End ``steep.turn.engine``; ``outputs``: each choice's token count and finish reason."""
    server = urlsplit(server_url)
    trace.end(
        {
            "gen_ai.usage.output_tokens": sum(tokens for tokens, _ in outputs),
            "gen_ai.response.finish_reasons": [reason or "" for _, reason in outputs],
            "server.address": server.hostname,
            "server.port": server.port,
        }
    )


def recorded(trace: Trace, response: dict) -> None:
    """End ``steep.turn.record``: the turn is committed; its usage goes on the root."""
    usage = response["usage"]
    trace.end()
    trace.note(
        {
            "gen_ai.response.id": response["id"],
            "gen_ai.response.model": response["model"],
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "gen_ai.response.finish_reasons": [c["finish_reason"] for c in response["choices"]],
        }
    )


def finished(trace: Trace, reply: Reply) -> None:
    """End the turn answered with ``reply`` (a refusal's code is the open phase's and the
    root's ``error.type``; a 5xx is an error)."""
    failed = {"error.type": reply.reason or f"http_{reply.status}"} if reply.status >= 400 else {}
    trace.end(failed)
    trace.finish(
        {"http.response.status_code": reply.status, **failed},
        error=(reply.reason or "server error") if reply.status >= 500 else None,
    )


def stream_ended(trace: Trace, error: BaseException | None) -> None:
    """End a streamed turn (``streaming.CompletionStream``): done, failed mid-stream, or its
    client went away (the turn is then recorded as aborted)."""
    if error is None:
        trace.finish({"http.response.status_code": 200})
    elif isinstance(error, asyncio.CancelledError | GeneratorExit):
        gone = {"error.type": "client_disconnected", "steep.aborted": True}
        trace.end(gone)
        trace.finish(gone, error="the client went away before the answer ended")
    else:
        code = error.code if isinstance(error, GatewayError) else "inference_error"
        trace.end({"error.type": code})
        trace.finish({"error.type": code}, error=str(error))
