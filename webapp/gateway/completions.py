"""One chat turn, read top to bottom: ``POST /agents/{agent_id}/v1/chat/completions``.

``chat_completion`` takes the request's parts (agent id, headers, body bytes) and returns a
``Reply``; the ASGI fast route (``webapp.gateway.asgi``), the Django view and the APIs that
translate onto chat turns (``webapp.gateway.chat_events``) call it. A turn is six steps, each a
call into the module that owns it, which returns:

1. the body, parsed and validated (``chat_request``);
2. a retry of an attempt still generating gets that attempt's answer (``inflight``);
3. authenticate and admit, one lane operation (``turns.begin``); a stream of a caller served
   recently starts its engine request beside it (``early``);
4. the prompt: the last turn's exact tokens continued, a branch's, or a fresh render (``prompts``);
5. the engine's answer (``inference``), streamed or not;
6. the turn recorded durably before the answer goes out (``turns.record``): here for a
   non-streamed turn, whose answer ``replies`` shapes; for ``stream: true`` by the stream
   (``streaming``), which sends tokens as they come and records the turn before its finish
   chunks and ``[DONE]``.

A failure after admission gives a one-turn session's admission slot back (``turns.discard``).
With traces on (``rl_core.tracing``), the turn is a trace and steps 3 to 6 its spans
(``webapp.gateway.traces``); with them off, each ``if trace is not None`` is all it costs.
"""

from __future__ import annotations

import asyncio
import time

from rl_core import tracing
from rl_core.ids import new_hex
from webapp.accounts.auth import bearer_token
from webapp.accounts.keys import hash_key
from webapp.gateway import early, inference, inflight, prompts, traces, turns
from webapp.gateway.chat_request import ChatRequest, read_chat_request
from webapp.gateway.errors import GatewayError
from webapp.gateway.lane import in_lane
from webapp.gateway.replies import Reply, completion, model_id, respond
from webapp.gateway.streaming import CompletionStream


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

    ``db`` runs the database operations: this process's lane (``lane.in_lane``), or, for
    Django's route, ``lane.in_thread``. A retry (``retry_count`` > 0, or an ``idempotency_key``)
    of a request already answered or still generating, in this web process or (with Redis) in
    another, gets that answer (``webapp.gateway.inflight``).
    """
    trace = traces.turn_trace(agent_id) if tracing.ON else None
    try:
        reply = await _turn(
            agent_id, authorization, content_type, body, retry_count, idempotency_key, db, trace
        )
    except GatewayError as exc:
        reply = Reply.error(exc)
    except BaseException as exc:
        if trace is not None:
            trace.finish(error=exc)
        raise
    if trace is not None and not trace.ends_later:  # a stream ends its trace itself
        traces.finished(trace, reply)
    return reply


async def _turn(
    agent_id, authorization, content_type, body, retry_count, idempotency_key, db, trace
) -> Reply:
    started = time.perf_counter()
    # 1. The body, parsed and validated.
    chat, fingerprint = read_chat_request(body, content_type)
    request_key = inflight.request_key(fingerprint, idempotency_key)
    token = bearer_token(authorization)
    caller = (str(agent_id), hash_key(token) if token else "")
    attempt = (*caller, request_key)
    is_retry = _is_retry(retry_count) or bool(idempotency_key)
    # 2. A retry of an attempt still generating gets its answer; one generating in another web
    # process is waited for, and ``turns.begin`` then finds its recorded answer.
    if is_retry:
        answer = await inflight.earlier_answer(attempt)
        if answer is not None:
            return respond(chat, answer)
    # 3. Authenticate and admit; a stream of a caller served recently starts its engine request
    # beside this trip (``early``).
    if trace is not None:
        trace.begin("steep.turn.admit")
    trip = db(
        turns.begin(
            token=token,
            agent_id=agent_id,
            fingerprint=request_key,
            is_retry=is_retry,
            model=chat.model,
        ),
        durable=False,  # an admission slot lost in an OS crash is recounted by the reconciler
    )
    ahead = early.early_request(chat, caller) if chat.stream and not is_retry else None
    if ahead is None:
        turn, early_stream = await trip, None
    else:
        turn, early_stream = await early.begin_beside(trip, ahead, caller)
    if trace is not None:
        traces.admitted(trace, turn)
    if turn.replay is not None:  # an SDK retry of a recorded turn: its answer, nothing recorded
        return respond(chat, turn.replay)
    if chat.stream:
        if turn.opened and turn.previous is None:  # a project key's one-turn stream
            early.EARLY_RUNS.remember(caller, turn.run)
        # A stream is not waited on by retries: its client going away aborts it, so an SDK
        # retry after a timeout finds an aborted turn and generates anew.
        return await _generate_and_record(chat, turn, request_key, started, db, trace, early_stream)
    # A client that may retry (the SDKs mark even their first attempt) leaves a marker for the
    # other web processes while this attempt generates.
    retriable = bool(retry_count) or bool(idempotency_key)
    async with inflight.generating(attempt, retriable=retriable) as answered:
        answer = await _generate_and_record(chat, turn, request_key, started, db, trace)
        answered.set_result(answer)
    return respond(chat, answer)


async def _generate_and_record(
    chat: ChatRequest,
    turn: turns.Turn,
    request_key: str,
    started: float,
    db,
    trace: tracing.Trace | None,
    early_stream: early.EarlyStream | None = None,
) -> dict | Reply:
    """Steps 4 to 6: the recorded response, or for ``stream`` the SSE Reply whose stream records
    the turn. On any failure the turn's session (a one-turn one opened for it) is discarded,
    giving its admission slot back."""
    try:
        run, interaction_id = turn.run, f"chatcmpl-{new_hex()}"
        # 4. The prompt.
        if trace is not None:
            trace.begin("steep.turn.render")
        tok, prompt = await prompts.turn_prompt(chat, turn, db, interaction_id)
        if trace is not None:
            traces.rendered(trace, prompt)
        # 5. The engine's answer.
        request = inference.engine_request(
            chat, tok, run, turn.sticky_server, prompt.input_ids, role=turn.role
        )
        if trace is not None:
            traces.engine_begins(trace, chat, run, request)
        record = {
            "request_hash": request_key,
            "messages": chat.messages,
            "tools": chat.tools,
            "sampling": request["sampling_params"] | {"n": chat.n, "seed": chat.seed},
            "input_ids": prompt.input_ids,
            "prefix_reused": prompt.reused,
            "previous_chosen": prompt.previous_chosen,
            "prefix": prompt.prefix,
        }
        if chat.stream:
            started_early = await early_stream.take(request) if early_stream is not None else None
            generation = started_early or await inference.generate_stream(**request)
            if trace is not None:
                traces.first_chunk(trace, early=started_early is not None)
            # 6. The stream owns the turn from here: it records it, or discards it on an error.
            stream = CompletionStream(
                chat=chat,
                tok=tok,
                generation=generation,
                interaction_id=interaction_id,
                model=model_id(run.base_model),
                record=record,
                started=started,
                turn=turn,
                db=db,
                trace=trace,
            )
            return Reply.sse(stream.events())
        answer = await inference.generate(**request)
        if trace is not None:
            traces.engine_ends(
                trace,
                answer.server_url,
                [(len(r.output_ids), r.finish_reason) for r in answer.results],
            )
        response, outputs = completion(
            chat, tok, run.base_model, interaction_id, prompt.input_ids, answer.results
        )
        # 6. The turn recorded, durably, before the answer goes out.
        if trace is not None:
            trace.begin("steep.turn.record")
        recorded = await db(
            turns.record(
                turn=turn,
                interaction_id=interaction_id,
                outputs=outputs,
                response=response,
                server_url=answer.server_url,
                latency_ms=(time.perf_counter() - started) * 1000,
                **record,
            )
        )
        if trace is not None:
            traces.recorded(trace, recorded.response)
        turns.remember(turn, recorded)  # committed: the session's next turn may start from it
        return recorded.response
    except BaseException:
        if early_stream is not None:
            await early_stream.drop()
        if turn.opened:
            await asyncio.shield(db(turns.discard(turn=turn), durable=False))
        raise


def _is_retry(retry_count: str) -> bool:
    try:
        return int(retry_count or "0") > 0
    except ValueError:
        return False
