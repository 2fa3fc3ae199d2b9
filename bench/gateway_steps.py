"""Where a gateway request's time goes: each step of ``chat_completions``, timed in-process.

Companion to ``bench/gateway.py``. It sets up the same fresh Steep (DATA_DIR, key,
online run, agent, the zero-latency stand-in attached), loads Django in this
process with the same environment, and times, one request at a time:

- the whole request through Django's ASGI application (no HTTP server, no socket
  to the client; the stand-in is still called over HTTP), and
- each step the view takes, called on its own exactly as the view calls it
  (the ORM calls inside ``sync_to_async``, as in ``webapp/gateway/views.py``),
- plus the cost of the machinery around them: an empty ``sync_to_async`` hop and
  a request to a view that does nothing, through the same middleware stack.

    .venv/bin/python bench/gateway_steps.py [--database sqlite|postgres] [-n 300]

It prints a table of wall-clock mean/p50/p90 ms per step and the process CPU
time per call (all threads; steadier than wall time on a busy machine). Numbers are per call, on an
otherwise idle process: the sum of the steps is what one request costs at one
connection; under load the event loop and the database add queueing on top.
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

# Every SQL statement and every new database connection, in any thread.
COUNTS = {"queries": 0, "connections": 0}
PER_STEP: dict[str, list[tuple[int, int]]] = {}
CPU: dict[str, list[float]] = {}  # process CPU time (all threads) per call, ms


def _count_query(execute, sql, params, many, context):
    COUNTS["queries"] += 1
    return execute(sql, params, many, context)


def install_counters() -> None:
    from django.db.backends.signals import connection_created

    def created(sender, connection, **kwargs):
        COUNTS["connections"] += 1
        connection.execute_wrappers.append(_count_query)

    connection_created.connect(created, weak=False)


def timed(samples: dict, name: str):
    class _T:
        def __enter__(self):
            self.q, self.c = COUNTS["queries"], COUNTS["connections"]
            self.cpu = time.process_time()
            self.t = time.perf_counter()

        def __exit__(self, *exc):
            samples.setdefault(name, []).append((time.perf_counter() - self.t) * 1000)
            CPU.setdefault(name, []).append((time.process_time() - self.cpu) * 1000)
            PER_STEP.setdefault(name, []).append(
                (COUNTS["queries"] - self.q, COUNTS["connections"] - self.c)
            )

    return _T()


async def asgi_request(app, path: str, body: bytes, headers: list[tuple[bytes, bytes]]):
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

    status = {}

    async def send(message):
        if message["type"] == "http.response.start":
            status["code"] = message["status"]

    await app(scope, receive, send)
    return status.get("code")


def experiment(a) -> None:
    """Settings changes for this process only (never the project's files)."""
    from django.conf import settings
    from django.utils.module_loading import import_string

    if a.middleware == "none":
        settings.MIDDLEWARE = []
    elif a.middleware == "async-only":
        settings.MIDDLEWARE = [
            m for m in settings.MIDDLEWARE if getattr(import_string(m), "async_capable", False)
        ]
    if a.sqlite_synchronous:
        from django.db.backends.signals import connection_created

        def pragma(sender, connection, **kwargs):
            if connection.vendor == "sqlite":
                with connection.cursor() as cursor:
                    cursor.execute(f"PRAGMA synchronous={a.sqlite_synchronous.upper()}")

        connection_created.connect(pragma, weak=False)


async def run_steps(n: int, agent_id: str, key: str, whole_only: bool = False) -> dict:
    from asgiref.sync import sync_to_async
    from django.conf import settings
    from django.core.asgi import get_asgi_application
    from django.http import JsonResponse

    from rl_core.chat import load_chat_tokenizer
    from webapp.gateway import selectors, services
    from webapp.gateway.inference import generate
    from webapp.gateway.prompts import build_prompt
    from webapp.gateway.requests import parse_chat_request
    from webapp.gateway.views import _completion

    app = get_asgi_application()
    body = json.dumps(g.CHAT_BODY).encode()
    path = f"/agents/{agent_id}/v1/chat/completions"
    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
    samples: dict[str, list[float]] = {}

    def db(fn):
        return sync_to_async(fn, thread_sensitive=False)

    # warm up: tokenizer cache, connections, httpx pool
    for _ in range(20):
        assert await asgi_request(app, path, body, headers) == 200

    for _ in range(n):
        with timed(samples, "whole request via Django ASGI app (in-process)"):
            code = await asgi_request(app, path, body, headers)
        assert code == 200, code
    if whole_only:
        return samples

    # no Authorization header: the view parses the body and answers 401 before any query, so
    # this is Django + the middleware stack + the view wrapper, with no database work
    for _ in range(n):
        with timed(samples, "request answered 401 (no key): Django + middleware only"):
            assert await asgi_request(app, path, body, headers[1:]) == 401

    for _ in range(n):
        with timed(samples, "one empty sync_to_async hop"):
            await db(lambda: None)()

    for _ in range(n):
        with timed(samples, "parse_chat_request + json.loads"):
            chat = parse_chat_request(json.loads(body))
        with timed(samples, "gateway_authenticate (key → agent)"):
            auth = await db(services.gateway_authenticate)(token=key, agent_id=agent_id)
        with timed(samples, "serving_run (refresh_from_db)"):
            run = await db(services.serving_run)(auth.agent)
        with timed(samples, "load_chat_tokenizer (cached) via sync_to_async"):
            tok = await db(load_chat_tokenizer)(run.base_model)
        with timed(samples, "chat.fingerprint (sha256 of messages)"):
            fingerprint = chat.fingerprint()
        with timed(samples, "build_prompt (render template + encode)"):
            prompt = build_prompt(tok, chat.messages, chat.rendered_tools, None)
        sampling = chat.sampling_params(max_new_tokens=8, stop_token_ids=tok.eos_token_ids)
        with timed(samples, "session_open (admission + insert, 1 txn)"):
            session, _ = await db(services.session_open)(agent=auth.agent, run=run, one_turn=True)
        with timed(samples, "  _admit_locked alone (2 COUNTs)"):
            await db(services._admit_locked)(run)
        with timed(samples, "server_candidates (select servers)"):
            await db(selectors.server_candidates)(run_id=run.id, sticky="")
        with timed(samples, "generate() total (candidates + HTTP + mark_up)"):
            generation = await generate(
                run_id=run.id,
                sticky=session.server_url,
                input_ids=prompt.input_ids,
                sampling_params=sampling,
                n=1,
                seed=None,
                top_logprobs=0,
            )
        with timed(samples, "inference_server_mark_up (UPDATE)"):
            await db(services.inference_server_mark_up)(run_id=run.id, url=generation.server_url)
        with timed(samples, "_completion (decode + response dict)"):
            response, outputs = _completion(
                chat, tok, run, "chatcmpl-x", prompt.input_ids, generation.results
            )
        with timed(samples, "interaction_record (lock + insert + update, 1 txn)"):
            await db(services.interaction_record)(
                session=session,
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
        with timed(samples, "JsonResponse(response)"):
            JsonResponse(response)

    from rl_core.inference.client import InferenceClient

    async with InferenceClient(settings.BENCH_STANDIN_URL) as client:
        for _ in range(n):
            with timed(samples, "  InferenceClient.generate alone (HTTP to stand-in)"):
                await client.generate(prompt.input_ids, sampling, rid="x")

    await django_overhead(samples, n, body, headers)
    return samples


async def django_overhead(samples: dict, n: int, body: bytes, headers) -> None:
    """Django's own cost: an async view that does nothing, behind each middleware stack."""
    import types

    from django.conf import settings
    from django.core.handlers.asgi import ASGIHandler
    from django.http import JsonResponse
    from django.urls import clear_url_caches, path
    from django.utils.module_loading import import_string
    from django.views.decorators.csrf import csrf_exempt

    @csrf_exempt
    async def noop(request):
        return JsonResponse({"ok": True})

    urls = types.ModuleType("bench_noop_urls")
    urls.urlpatterns = [path("noop", noop)]
    sys.modules["bench_noop_urls"] = urls
    saved_urlconf, saved_middleware = settings.ROOT_URLCONF, list(settings.MIDDLEWARE)
    settings.ROOT_URLCONF = "bench_noop_urls"
    clear_url_caches()
    stacks = {
        "settings.MIDDLEWARE": saved_middleware,
        "async-capable middleware only": [
            m for m in saved_middleware if getattr(import_string(m), "async_capable", False)
        ],
        "no middleware": [],
    }
    try:
        for label, middleware in stacks.items():
            settings.MIDDLEWARE = middleware
            app = ASGIHandler()
            for _ in range(20):
                await asgi_request(app, "/noop", body, headers)
            for _ in range(n):
                with timed(samples, f"no-op async view, {label}"):
                    assert await asgi_request(app, "/noop", body, headers) == 200
    finally:
        settings.ROOT_URLCONF, settings.MIDDLEWARE = saved_urlconf, saved_middleware
        clear_url_caches()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database", default="sqlite", choices=["sqlite", "postgres"])
    p.add_argument("-n", type=int, default=300, help="calls per step (default 300)")
    p.add_argument("--debug", action="store_true", help="run with DEBUG=true (the laptop default)")
    p.add_argument(
        "--middleware",
        default="all",
        choices=["all", "async-only", "none"],
        help="experiment: keep settings.MIDDLEWARE (all), drop the middlewares that are not "
        "async-capable (async-only), or drop every middleware (none); this process only",
    )
    p.add_argument(
        "--sqlite-synchronous",
        choices=["full", "normal", "off"],
        help="experiment: PRAGMA synchronous on every SQLite connection of this process",
    )
    p.add_argument("--whole-only", action="store_true", help="time only the whole request")
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
        install_counters()
        experiment(a)
        from django.conf import settings

        settings.BENCH_STANDIN_URL = bench.standin_url
        try:
            import uvloop

            samples = uvloop.run(run_steps(a.n, agent_id, key, a.whole_only))
        except ImportError:
            samples = asyncio.run(run_steps(a.n, agent_id, key, a.whole_only))
    finally:
        g.stop_all()
    width = max(len(k) for k in samples)
    print(
        f"Steep gateway steps, {a.database}, DEBUG={env['DEBUG']}, middleware={a.middleware}, "
        f"sqlite synchronous={a.sqlite_synchronous or 'default'}, n={a.n} (ms per call)\n"
    )
    print(
        f"| {'step'.ljust(width)} | wall mean | wall p50 | wall p90 | CPU mean | SQL statements | new DB connections |"
    )
    print(f"|{'-' * (width + 2)}|---:|---:|---:|---:|---:|---:|")
    for name, xs in samples.items():
        xs_sorted = sorted(xs)
        p90 = xs_sorted[int(0.9 * (len(xs_sorted) - 1))]
        counts = PER_STEP.get(name) or [(0, 0)]
        queries = statistics.fmean(q for q, _ in counts)
        conns = statistics.fmean(c for _, c in counts)
        print(
            f"| {name.ljust(width)} | {statistics.fmean(xs):.3f} | {statistics.median(xs):.3f} "
            f"| {p90:.3f} | {statistics.fmean(CPU[name]):.3f} | {queries:.1f} | {conns:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
