"""A turn's trace (``webapp.gateway.traces``): the gateway's ASGI app in this process (so an
in-memory exporter sees its spans), called by the official ``openai`` SDK, answers from the
shared torch engine. One trace per turn, its phases in order, each span with the request id,
token counts as the response and the recorded row say; with traces off, no span at all."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from asgiref.sync import sync_to_async
from openai import AsyncOpenAI, AuthenticationError
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rl_core import tracing
from webapp.gateway.models import Interaction

# One event loop for the module: the gateway keeps its engine clients per event loop.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio(loop_scope="module")]

HI = [{"role": "user", "content": "Hi"}]
TURN = [
    "steep.turn",
    "steep.turn.admit",
    "steep.turn.render",
    "steep.turn.engine",
    "steep.turn.record",
]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Traces on, into memory, for this test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)
    provider.shutdown()


@pytest.fixture(scope="module")
def app():
    """The web app's HTTP side as ``webapp.asgi`` builds it: the gateway's fast route."""
    from django.core.asgi import get_asgi_application

    from webapp.gateway.asgi import fast_route

    return fast_route(get_asgi_application())


def agent(gw, app, key: str | None = None) -> AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    return AsyncOpenAI(
        base_url=f"http://127.0.0.1/agents/{gw.agent.id}/v1",
        api_key=key or gw.key,
        http_client=httpx.AsyncClient(transport=transport, timeout=60),
        max_retries=0,
    )


def trace_of(exporter: InMemorySpanExporter, request_id: str) -> list[ReadableSpan]:
    """The one trace of request ``request_id``: its spans by start time, the root first."""
    found = [
        s for s in exporter.get_finished_spans() if s.attributes["steep.request_id"] == request_id
    ]
    assert found, "no span carries the request id"
    assert len({s.context.trace_id for s in found}) == 1
    found.sort(key=lambda s: s.start_time)
    root, children = found[0], found[1:]
    assert root.parent is None
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in children)
    for before, after in zip(children, children[1:], strict=False):
        assert before.end_time <= after.start_time  # one phase after another
    assert all(root.start_time <= s.start_time and s.end_time <= root.end_time for s in children)
    return found


def interaction(pk: str) -> Interaction:
    return Interaction.objects.get(pk=pk)


async def test_a_chat_turn_is_one_trace_with_its_phases_in_order_and_its_token_counts(
    spans, gw, app, engine
):
    client = agent(gw, app)
    raw = await client.chat.completions.with_raw_response.create(
        model=gw.model, messages=HI, max_tokens=8, extra_headers={"X-Request-ID": "turn-trace-1"}
    )
    completion = raw.parse()
    row = await sync_to_async(interaction)(completion.id)

    assert raw.headers["x-request-id"] == "turn-trace-1"
    turn = trace_of(spans, "turn-trace-1")
    assert [s.name for s in turn] == TURN
    root, admit, render, call, record = turn
    assert root.kind == SpanKind.SERVER and call.kind == SpanKind.CLIENT
    usage = completion.usage
    assert usage.prompt_tokens == len(row.input_ids)
    assert usage.completion_tokens == len(row.outputs[0]["output_ids"]) <= 8
    assert dict(root.attributes) == {
        "steep.request_id": "turn-trace-1",
        "gen_ai.operation.name": "chat",
        "gen_ai.agent.id": str(gw.agent.id),
        "gen_ai.conversation.id": str(row.session_id),
        "gen_ai.request.model": gw.model,
        "steep.run_id": str(gw.run.id),
        "gen_ai.response.id": completion.id,
        "gen_ai.response.model": completion.model,
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.response.finish_reasons": (completion.choices[0].finish_reason,),
        "http.response.status_code": 200,
    }
    assert admit.attributes["steep.session.opened"] is True  # the project key's one-turn session
    assert render.attributes["steep.prompt.tokens"] == usage.prompt_tokens
    assert call.attributes["gen_ai.operation.name"] == "chat"
    assert call.attributes["gen_ai.request.model"] == gw.model
    assert call.attributes["gen_ai.request.max_tokens"] == 8
    assert call.attributes["gen_ai.request.stream"] is False
    assert call.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert call.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert call.attributes["gen_ai.response.finish_reasons"] == (row.outputs[0]["finish_reason"],)
    assert call.attributes["server.port"] == int(engine.url.rsplit(":", 1)[1])
    assert "gen_ai.response.time_to_first_chunk" not in call.attributes  # not streamed
    assert all(s.status.status_code == StatusCode.UNSET for s in turn)
    assert {s.attributes["steep.request_id"] for s in turn} == {"turn-trace-1"}


async def test_a_streamed_turn_ends_its_trace_with_the_stream_and_times_the_first_chunk(
    spans, gw, app
):
    client = agent(gw, app)
    stream = await client.chat.completions.create(
        model=gw.model,
        messages=HI,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-ID": "turn-trace-stream"},
    )
    chunks = [chunk async for chunk in stream]
    usage = chunks[-1].usage
    row = await sync_to_async(interaction)(chunks[0].id)

    turn = trace_of(spans, "turn-trace-stream")
    assert [s.name for s in turn] == TURN
    root, _, _, call, record = turn
    assert usage.prompt_tokens == len(row.input_ids)
    assert usage.completion_tokens == len(row.outputs[0]["output_ids"])
    assert root.attributes["gen_ai.response.id"] == row.id
    assert root.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert call.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert call.attributes["gen_ai.request.stream"] is True
    first = call.attributes["gen_ai.response.time_to_first_chunk"]
    assert 0 < first * 1e9 <= call.end_time - call.start_time
    assert record.end_time <= root.end_time  # the root ends with the stream, after the record
    assert {s.attributes["steep.request_id"] for s in turn} == {"turn-trace-stream"}


async def test_a_response_through_the_responses_api_is_the_same_turn_trace(spans, gw, app):
    client = agent(gw, app)
    response = await client.responses.create(
        model=gw.model,
        input="Hi",
        max_output_tokens=8,
        extra_headers={"X-Request-ID": "turn-trace-responses"},
    )

    turn = trace_of(spans, "turn-trace-responses")
    assert [s.name for s in turn] == TURN
    assert turn[0].attributes["gen_ai.response.id"] == response.id
    assert turn[0].attributes["gen_ai.usage.input_tokens"] == response.usage.input_tokens
    assert turn[3].attributes["gen_ai.usage.output_tokens"] == response.usage.output_tokens


async def test_a_refused_turn_ends_at_admission_with_the_refusals_code(spans, gw, app):
    client = agent(gw, app, key="sk-steep-not-a-key")
    with pytest.raises(AuthenticationError) as refused:
        await client.chat.completions.create(
            model=gw.model, messages=HI, extra_headers={"X-Request-ID": "turn-trace-401"}
        )

    code = refused.value.body["code"]
    root, admit = trace_of(spans, "turn-trace-401")
    assert (root.name, admit.name) == ("steep.turn", "steep.turn.admit")
    assert root.attributes["http.response.status_code"] == 401
    assert root.attributes["error.type"] == admit.attributes["error.type"] == code
    assert root.status.status_code == StatusCode.UNSET  # a client's error, not the server's


async def test_with_traces_off_a_turn_creates_no_span(gw, app, monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    tracing.use(None)  # on, then off again: nothing may reach the provider

    def no_trace(*args, **kwargs):
        raise AssertionError("a trace was begun with traces off")

    monkeypatch.setattr(tracing.Trace, "__init__", no_trace)
    client = agent(gw, app)
    completion = await client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4)
    stream = await client.chat.completions.create(
        model=gw.model, messages=HI, max_tokens=4, stream=True
    )
    streamed = [chunk async for chunk in stream]

    assert tracing.ON is False
    assert completion.choices[0].message.role == "assistant" and streamed
    assert exporter.get_finished_spans() == ()
