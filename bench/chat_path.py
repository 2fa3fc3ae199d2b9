"""How many modules one chat turn visits: the chat path, traced module by module (issue 36).

It sets up a fresh Steep as ``bench/gateway.py`` does (DATA_DIR, SQLite, key, online run, agent,
the stand-in engine attached, 8 tokens an answer, streamed at 20 ms a token so that each comes
in a read of its own), loads Django in this process and sends three ``/chat/completions``
turns through ``webapp.asgi.application`` (the fast route, in-process, no socket), each after
an untraced one of the same kind so that every cache is warm (the tokenizer, the template's
probes, the HTTP pool, the lane, the server list):

1. ``non-streamed``: the first turn of a session;
2. ``streamed``: the first turn of another session, ``stream: true``;
3. ``continuing``: the first session's second turn (its messages continue the first).

While a turn runs, a profiler (``sys.setprofile``, and ``threading.setprofile`` for the lane's
thread) notes which module the chat path is in: a function of ``webapp/gateway/*.py`` or
``rl_core/chat.py`` starting, or a function returning to one of them. A *stop* is an entry of
the resulting sequence with repeats collapsed (each time the path moves to another module);
a *return* is a stop at a module the path already left during that turn. Coroutine suspensions
and resumptions (the event loop's doing, not the code's) are not moves; a generator's first
start and its final return are. The lane thread's own idle loop is left out. Every call counts,
helpers' too: the SQL helpers (``sql``), SQLite's cursor (``lane.RawCursor``; PostgreSQL's is
the driver's own), the tokenizer, and a stream's per-token work (8 tokens here).

    .venv/bin/python bench/chat_path.py [--quiet]

It prints, per turn, the counts, how many times the path entered each module, and the module
sequence; ``--quiet`` leaves the sequences out. Runs take ~10 s; the counts do not depend on
timing (the same on every run).
"""

from __future__ import annotations

import argparse
import asyncio
import dis
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import gateway as g  # noqa: E402  (bench/gateway.py)
from gateway_steps import asgi_request  # noqa: E402

GATEWAY = str(ROOT / "webapp" / "gateway") + os.sep
CHAT = str(ROOT / "rl_core" / "chat.py")
_YIELD = dis.opmap["YIELD_VALUE"]
_RESUME = dis.opmap["RESUME"]


class ModuleTrace:
    """The modules of the chat path a piece of code moves through, in order (repeats collapsed)."""

    def __init__(self) -> None:
        self.active = False
        self.sequence: list[str] = []
        self._names: dict[str, str | None] = {}
        self._starts: dict[object, int] = {}  # code → offset of its first RESUME
        self._lock = threading.Lock()

    def module(self, code) -> str | None:
        name = self._names.get(code.co_filename, "")
        if name == "":
            path = code.co_filename
            if path == CHAT:
                name = "rl_core.chat"
            elif path.startswith(GATEWAY) and os.sep not in path[len(GATEWAY) :]:
                name = Path(path).stem
            else:
                name = None
            self._names[code.co_filename] = name
        return name

    def _first_resume(self, code) -> int:
        start = self._starts.get(code)
        if start is None:
            start = next(
                (i for i in range(0, len(code.co_code), 2) if code.co_code[i] == _RESUME), 0
            )
            self._starts[code] = start
        return start

    def _at(self, name: str | None) -> None:
        if name is None:
            return
        with self._lock:
            if not self.sequence or self.sequence[-1] != name:
                self.sequence.append(name)

    def profile(self, frame, event: str, arg) -> None:
        if not self.active:
            return
        if event == "call":
            code = frame.f_code
            # A generator or coroutine resumed is not a call: its frame starts past its first RESUME.
            if frame.f_lasti == self._first_resume(code):
                self._at(self.module(code))
        elif event == "return":
            code = frame.f_code
            if frame.f_lasti >= 0 and code.co_code[frame.f_lasti] == _YIELD:
                return  # a yield or a suspension, not a return
            back = frame.f_back
            if back is not None and back.f_code.co_name != "_serve":  # the lane's idle loop
                self._at(self.module(back.f_code))


def counts(sequence: list[str]) -> tuple[int, int, int]:
    """(stops, returns, distinct modules) of a module sequence."""
    seen: set[str] = set()
    returns = 0
    for name in sequence:
        returns += name in seen
        seen.add(name)
    return len(sequence), returns, len(seen)


# The modules issue 36 counted a request's body going through, back and forth.
NAMED = ("completions", "chat_request", "prompts", "rl_core.chat", "turns")


def only(sequence: list[str], names: tuple[str, ...]) -> list[str]:
    """``sequence`` seen only at ``names`` (the other modules left out, repeats collapsed)."""
    out: list[str] = []
    for name in sequence:
        if name in names and (not out or out[-1] != name):
            out.append(name)
    return out


async def call(app, path: str, body: dict, key: str) -> tuple[int, bytes]:
    """One POST through the ASGI app: its status and whole body (a stream read to its end)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {key}".encode()),
    ]
    return await asgi_request(app, path, json.dumps(body).encode(), headers)


def answer_of(body: bytes, stream: bool) -> dict:
    """The assistant message a turn answered (a stream's content deltas put together)."""
    if not stream:
        return json.loads(body)["choices"][0]["message"]
    content = ""
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                content += choice.get("delta", {}).get("content") or ""
    return {"role": "assistant", "content": content}


async def turns_traced(agent_id: str, project_key: str, trace: ModuleTrace) -> dict:
    from webapp.asgi import application
    from webapp.gateway.caches import CACHES

    base = f"/agents/{agent_id}/v1"

    async def session() -> str:
        status, body = await call(application, base + "/rl/start_session", {}, project_key)
        assert status == 201, body
        return json.loads(body)["api_key"]

    def first(task: str, stream: bool) -> dict:
        messages = [{"role": "user", "content": f"{task}: what is 2+2?"}]
        return {"model": "policy", "messages": messages, "max_tokens": 8, "stream": stream}

    def then(request: dict, answer: dict) -> dict:
        more = [answer, {"role": "user", "content": "And 3+3?"}]
        return {**request, "messages": [*request["messages"], *more], "stream": False}

    async def turn(key: str, request: dict, traced: str | None) -> dict:
        for entry in list(CACHES.servers):  # the server list as cached between requests
            expiry, servers = CACHES.servers[entry]
            CACHES.servers[entry] = (time.monotonic() + 60, servers)
        if traced is not None:
            trace.sequence = []
            trace.active = True
        try:
            status, body = await call(application, base + "/chat/completions", request, key)
        finally:
            trace.active = False
        await asyncio.sleep(0.05)  # what the turn left to the event loop (a cancelled watcher) ends
        assert status == 200, body
        if traced is not None:
            traces[traced] = list(trace.sequence)
        return answer_of(body, request["stream"])

    traces: dict[str, list[str]] = {}
    sys.setprofile(trace.profile)  # the event loop's thread; the lane's has threading's
    try:
        for traced in (False, True):  # first untraced (warm-up), then the same traced
            key_a, key_b = await session(), await session()
            request_a = first(f"{'traced' if traced else 'warm-up'} a", stream=False)
            answer_a = await turn(key_a, request_a, "non-streamed" if traced else None)
            request_b = first(f"{'traced' if traced else 'warm-up'} b", stream=True)
            await turn(key_b, request_b, "streamed" if traced else None)
            await turn(key_a, then(request_a, answer_a), "continuing" if traced else None)
    finally:
        sys.setprofile(None)
    return traces


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quiet", action="store_true", help="print the counts only")
    a = p.parse_args(argv)
    args = g.parse_args(
        ["--workload", "ttft", "--database", "sqlite", "--tokens", "8", "--token-delay-ms", "20"]
    )
    workdir = g.RUNS / f"chat-path-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    bench = g.Bench(args, workdir)
    trace = ModuleTrace()
    try:
        bench.start_standin()
        env, key, agent_id, _ = bench.steep_setup("sqlite", 1, g.free_port())
        os.environ.clear()
        os.environ.update(env)
        threading.setprofile(trace.profile)  # threads started from here on: the lane's
        import django

        django.setup()
        traces = asyncio.run(turns_traced(agent_id, key, trace))
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        bench.processes.stop()
    total = [0, 0]
    print("Chat path, module by module (webapp/gateway/*.py and rl_core/chat.py)\n")
    print("| turn | stops | returns | modules |")
    print("|---|---:|---:|---:|")
    for name, sequence in traces.items():
        stops, returns, modules = counts(sequence)
        total = [total[0] + stops, total[1] + returns]
        print(f"| {name} | {stops} | {returns} | {modules} |")
    print(f"| all three | {total[0]} | {total[1]} | |")
    print(f"\nThe same sequence seen only at the modules issue 36 names ({', '.join(NAMED)})\n")
    print("| turn | stops | returns |")
    print("|---|---:|---:|")
    for name, sequence in traces.items():
        stops, returns, _ = counts(only(sequence, NAMED))
        print(f"| {name} | {stops} | {returns} |")
    print("\nTimes the path entered each module\n")
    print("| module | " + " | ".join(traces) + " |")
    print("|---|" + "---:|" * len(traces))
    entered = {name: Counter(sequence) for name, sequence in traces.items()}
    for module in sorted(set().union(*entered.values())):
        print(f"| {module} | " + " | ".join(str(c[module]) for c in entered.values()) + " |")
    if not a.quiet:
        for name, sequence in traces.items():
            print(f"\n{name}: " + " > ".join(sequence))
    return 0


if __name__ == "__main__":
    sys.exit(main())
