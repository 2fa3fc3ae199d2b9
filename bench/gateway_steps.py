"""Where a gateway request's time goes: each step of a chat completion, timed in-process.

Companion to ``bench/gateway.py``. It sets up the same fresh Steep (DATA_DIR, key,
online run, agent, the zero-latency stand-in attached), loads Django in this
process with the same environment, and times, one request at a time:

- the whole request through ``webapp.asgi.application`` (the fast route; no HTTP
  server, no socket to the client; the stand-in is still called over HTTP), and
- each step ``webapp.gateway.completions`` takes, called on its own as it calls it
  (the database work as lane operations, as in ``webapp/gateway/turns.py``),
- plus the machinery around them: an empty lane round trip and a request refused
  before any database work.

    .venv/bin/python bench/gateway_steps.py [--database sqlite|postgres] [-n 300]
    .venv/bin/python bench/gateway_steps.py --whole-only -n 1000 --tracing memory

``--tracing memory`` turns traces on (``rl_core.tracing``), into an in-memory exporter behind
the SDK's batch processor (its thread's CPU counts): what a traced turn costs the gateway. The
steps then include the turn's trace on its own: ``webapp.gateway.traces``' calls for one turn
(five spans and their attributes), made with each step's real objects. ``--tracing dropped``:
traces on, every one dropped by the sampler (what a turn left out by sampling costs).

It prints a table of wall-clock mean/p50/p90 ms per step, the process CPU time per
call (all threads; steadier than wall time on a busy machine) and the SQL statements
per call. Numbers are per call, on an otherwise idle process: the sum of the steps is
what one request costs at one connection; under load the event loop and the lane add
queueing on top (and the lane commits many requests at once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gateway as g  # noqa: E402  (bench/gateway.py)

CPU: dict[str, list[float]] = {}  # process CPU time (all threads) per call, ms


def timed(samples: dict, name: str):
    class _T:
        def __enter__(self):
            self.cpu = time.process_time()
            self.t = time.perf_counter()

        def __exit__(self, *exc):
            samples.setdefault(name, []).append((time.perf_counter() - self.t) * 1000)
            CPU.setdefault(name, []).append((time.process_time() - self.cpu) * 1000)

    return _T()


async def asgi_request(app, path: str, body: bytes, headers: list[tuple[bytes, bytes]]):
    """One POST through the ASGI app, in process: its status and whole body (a stream read to
    its end)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent = {"done": False}

    async def receive():
        if not sent["done"]:
            sent["done"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    status, chunks = {}, []

    async def send(message):
        if message["type"] == "http.response.start":
            status["code"] = message["status"]
        else:
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status.get("code"), b"".join(chunks)


async def run_steps(n: int, agent_id: str, key: str, whole_only: bool = False) -> dict:
    from rl_core import tracing
    from webapp.asgi import application
    from webapp.gateway import traces, turns
    from webapp.gateway.chat_request import parse_chat_request
    from webapp.gateway.inference import generate
    from webapp.gateway.lane import lane
    from webapp.gateway.prompts import build_prompt
    from webapp.gateway.prompts import tokenizer as _tokenizer
    from webapp.gateway.replies import Reply
    from webapp.gateway.replies import completion as _completion
    from webapp.gateway.replies import respond as _respond

    body = json.dumps(g.CHAT_BODY).encode()
    path = f"/agents/{agent_id}/v1/chat/completions"
    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
    samples: dict[str, list[float]] = {}

    # warm up: tokenizer cache, the lane's connection, the HTTP pool
    for _ in range(20):
        assert (await asgi_request(application, path, body, headers))[0] == 200

    for _ in range(n):
        with timed(samples, "whole request via the ASGI app (in-process)"):
            code, _ = await asgi_request(application, path, body, headers)
        assert code == 200, code
    if whole_only:
        return samples

    for _ in range(n):
        with timed(samples, "request answered 401 (no key): routing + parsing only"):
            assert (await asgi_request(application, path, body, headers[1:]))[0] == 401

    for _ in range(n):
        with timed(samples, "one empty lane round trip (queue, commit, wake-up)"):
            await lane().run(lambda cursor: None)

    for _ in range(n):
        with timed(samples, "parse_chat_request + json.loads + fingerprint"):
            chat = parse_chat_request(json.loads(body))
            fingerprint = chat.fingerprint()
        with timed(samples, "lane: begin (auth + admission)"):
            turn = await lane().run(
                turns.begin(token=key, agent_id=agent_id, fingerprint=fingerprint, is_retry=False),
                durable=False,  # as completions runs it
            )
        with timed(samples, "build_prompt (render template + encode)"):
            tok = await _tokenizer(turn.run.base_model)
            prompt = build_prompt(tok, chat.messages, chat.rendered_tools, None)
        sampling = chat.sampling_params(max_new_tokens=8, stop_token_ids=tok.eos_token_ids)
        with timed(samples, "generate (HTTP to the stand-in)"):
            generation = await generate(
                run_id=turn.run.id,
                sticky="",
                input_ids=prompt.input_ids,
                sampling_params=sampling,
                n=1,
                seed=None,
                top_logprobs=0,
            )
        with timed(samples, "_completion (decode + response dict)"):
            response, outputs = _completion(
                chat, tok, turn.run.base_model, "x", prompt.input_ids, generation.results
            )
        with timed(samples, "lane: record (session + interaction rows)"):
            recorded = await lane().run(
                turns.record(
                    turn=turn,
                    interaction_id=f"chatcmpl-steps-{time.perf_counter_ns()}",
                    request_hash=fingerprint,
                    messages=chat.messages,
                    tools=chat.tools,
                    sampling=sampling | {"n": 1, "seed": None},
                    input_ids=prompt.input_ids,
                    prefix_reused=prompt.reused,
                    outputs=outputs,
                    response=response,
                    server_url=generation.server_url,
                    latency_ms=1.0,
                    previous_chosen=None,
                )
            )
        with timed(samples, "response JSON (Reply)"):
            reply = _respond(chat, recorded)
            assert isinstance(reply, Reply)
        if tracing.ON:
            outputs = [(len(r.output_ids), r.finish_reason) for r in generation.results]
            request = {"sampling_params": sampling, "input_ids": prompt.input_ids}
            with timed(samples, "the turn's trace alone (5 spans, their attributes)"):
                trace = traces.turn_trace(agent_id)
                if trace is not None:  # None: the sampler dropped it (--tracing dropped)
                    trace.begin("steep.turn.admit")
                    traces.admitted(trace, turn)
                    trace.begin("steep.turn.render")
                    traces.rendered(trace, prompt)
                    traces.engine_begins(trace, chat, turn.run, request)
                    traces.engine_ends(trace, generation.server_url, outputs)
                    trace.begin("steep.turn.record")
                    traces.recorded(trace, recorded.response)
                    traces.finished(trace, reply)
    return samples


def _trace_into_memory(dropped: bool):
    """Traces on into memory (``dropped``: every trace dropped by the sampler); returns a
    function that counts the spans exported so far."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from rl_core import tracing

    provider = TracerProvider(sampler=ALWAYS_OFF) if dropped else TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracing.use(provider)
    return lambda: provider.force_flush() and len(exporter.get_finished_spans())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database", default="sqlite", choices=["sqlite", "postgres"])
    p.add_argument("-n", type=int, default=300, help="calls per step (default 300)")
    p.add_argument("--debug", action="store_true", help="run with DEBUG=true (the laptop default)")
    p.add_argument("--whole-only", action="store_true", help="time only the whole request")
    p.add_argument(
        "--tracing",
        default="off",
        choices=["off", "memory", "dropped"],
        help="traces off, into memory, or on and all dropped by the sampler",
    )
    a = p.parse_args(argv)
    args = g.parse_args(["--database", a.database])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = g.RUNS / f"gateway-steps-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    bench = g.Bench(args, workdir)
    try:
        bench.start_standin()
        env, key, agent_id, _ = bench.steep_setup(a.database, 1, g.free_port())
        env["DEBUG"] = "true" if a.debug else "false"
        os.environ.clear()
        os.environ.update(env)
        import django

        django.setup()
        from django.conf import settings

        settings.BENCH_STANDIN_URL = bench.standin_url
        spans = _trace_into_memory(a.tracing == "dropped") if a.tracing != "off" else None
        try:
            import uvloop

            samples = uvloop.run(run_steps(a.n, agent_id, key, a.whole_only))
        except ImportError:
            samples = asyncio.run(run_steps(a.n, agent_id, key, a.whole_only))
        if spans is not None:
            print(f"spans exported: {spans()}")
    finally:
        bench.processes.stop()
    width = max(len(k) for k in samples)
    print(
        f"Steep gateway steps, {a.database}, DEBUG={env['DEBUG']}, tracing {a.tracing}, n={a.n} "
        "(ms per call)\n"
    )
    print(f"| {'step'.ljust(width)} | wall mean | wall p50 | wall p90 | CPU mean |")
    print(f"|{'-' * (width + 2)}|---:|---:|---:|---:|")
    for name, xs in samples.items():
        xs_sorted = sorted(xs)
        p90 = xs_sorted[int(0.9 * (len(xs_sorted) - 1))]
        print(
            f"| {name.ljust(width)} | {statistics.fmean(xs):.3f} | {statistics.median(xs):.3f} "
            f"| {p90:.3f} | {statistics.fmean(CPU[name]):.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
