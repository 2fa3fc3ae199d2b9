"""The load generator of ``bench/gateway.py --workload sessions``: agents looping through
episodes, in several client processes.

An agent's episode is what a real agent makes (``webapp/agents/snippets.py``)::

    POST {base}/rl/start_session       project key          -> 201 {"session_id", "api_key"}
    POST {base}/chat/completions  x k  the session key       the conversation so far: every
                                                             earlier message, the answer it got,
                                                             one new user message
    POST {base}/rl/set_reward          {"reward": 1.0}
    POST {base}/rl/end_session

``base`` is any URL those paths hang from: Steep's ``/agents/{id}/v1``, or the stand-in's
``/v1`` (it answers the three ``/rl/*`` paths with canned JSON), which measures this client's
own ceiling. With ``sessions=False`` an episode is only its k turns, every one sent with
``key``: a peer without the RL protocol (LiteLLM), or, with k = 1, one-turn completions.

The agents are split over ``procs`` processes (spawned), each one event loop (uvloop when
installed) with one aiohttp session and a connection per agent, so that one Python
process's CPU does not cap the load. They start together, load for ``warmup`` seconds
unmeasured and ``duration`` seconds measured, then stop issuing requests (a request in
flight is awaited; an episode cut short is left as it is). Each process sends back its
latencies by endpoint for the measured window and its counts of acknowledged (2xx) answers
and errors over the whole cell, warm-up included: the counts to compare with the rows a
target recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import multiprocessing as mp
import os
import queue
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field

ENDPOINTS = ("start", "turn", "reward", "end")
QUESTIONS = ["What is 2+2?", "And 3+3?", "And 4+4?", "Add them up.", "Are you sure?"]
_EPISODES = itertools.count()  # this client process's episodes (--distinct-conversations)
START_BODY = json.dumps({"task_id": "bench", "metadata": {"bench": "sessions"}}).encode()
REWARD_BODY = json.dumps({"reward": 1.0}).encode()
ERROR_SAMPLES = 5  # per process: the first few error answers, for the report


@dataclass(frozen=True)
class LoadConfig:
    """One cell of the sessions workload."""

    base: str  # the URL the paths hang from: {base}/rl/start_session, {base}/chat/completions
    key: str  # the project key (the bearer of every call when sessions is False)
    agents: int  # agents looping at once
    turns: int  # chat turns per episode (k)
    duration: float  # seconds measured
    warmup: float  # seconds of load before, unmeasured
    procs: int = 2  # client processes the agents are split over
    sessions: bool = True  # False: an episode is its turns only (a peer without /rl/*)
    model: str = "policy"
    max_tokens: int = 8
    timeout: float = 30.0  # seconds per request before it counts as an error
    collect_ids: bool = False  # also send back the ids acknowledged (bench/load.py checks them)
    distinct: bool = False  # each episode's first message its own (no prompt-cache hits)


@dataclass
class LoadResult:
    """What the client saw in one cell; latencies in ms, counts by endpoint."""

    agents: int
    turns: int
    procs: int
    seconds: float  # the measured window
    episodes: int  # episodes whose last request completed in the window
    requests: dict[str, int]  # 2xx answers completed in the window
    p50_ms: dict[str, float]
    p99_ms: dict[str, float]
    acknowledged: dict[str, int]  # 2xx answers in the whole cell (warm-up and tail included)
    errors: dict[str, int]  # non-2xx answers and exceptions in the whole cell
    error_samples: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)  # non-2xx answers by status
    # With collect_ids: the completion ids answered ("turn") and the sessions ended ("end").
    ids: dict[str, list[str]] = field(default_factory=dict)

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.seconds

    def rps(self, endpoint: str | None = None) -> float:
        """Requests per second in the window: one endpoint's, or all of them."""
        count = self.requests.get(endpoint, 0) if endpoint else sum(self.requests.values())
        return count / self.seconds


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_load(config: LoadConfig) -> LoadResult:
    """Run one cell: start the client processes, load, merge what they saw."""
    procs = max(1, min(config.procs, config.agents))
    shares = [config.agents // procs + (i < config.agents % procs) for i in range(procs)]
    ctx = mp.get_context("spawn")  # a clean interpreter: no state inherited from the bench
    out, go, start_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    children = [
        ctx.Process(target=_client_main, args=(config, n, go, start_at, out), daemon=True)
        for n in shares
    ]
    for child in children:
        child.start()
    try:
        for _ in children:
            if _receive(out, children, 60) != "ready":
                raise RuntimeError("a client process did not start")
        start_at.value = time.monotonic() + 0.05
        go.set()
        patience = config.warmup + config.duration + config.timeout + 60
        parts = [_receive(out, children, patience) for _ in children]
    finally:
        for child in children:
            child.join(5)
            if child.is_alive():
                child.kill()
                child.join(5)
    latencies: dict[str, list[float]] = {e: [] for e in ENDPOINTS}
    totals = {name: dict.fromkeys(ENDPOINTS, 0) for name in ("requests", "ok", "errors")}
    episodes, samples, statuses, ids = 0, [], {}, {"turn": [], "end": []}
    for part in parts:
        episodes += part["episodes"]
        samples += part["error_samples"]
        for status, n in part["statuses"].items():
            statuses[status] = statuses.get(status, 0) + n
        for endpoint in ids:
            ids[endpoint] += part["ids"][endpoint]
        for endpoint in ENDPOINTS:
            latencies[endpoint] += part["latencies"][endpoint]
            for name in totals:
                totals[name][endpoint] += part[name][endpoint]
    used = [e for e in ENDPOINTS if totals["requests"][e] or totals["ok"][e] or totals["errors"][e]]
    return LoadResult(
        agents=config.agents,
        turns=config.turns,
        procs=procs,
        seconds=config.duration,
        episodes=episodes,
        requests={e: totals["requests"][e] for e in used},
        p50_ms={e: percentile(latencies[e], 0.50) * 1000 for e in used},
        p99_ms={e: percentile(latencies[e], 0.99) * 1000 for e in used},
        acknowledged={e: totals["ok"][e] for e in used},
        errors={e: totals["errors"][e] for e in used},
        error_samples=samples[:ERROR_SAMPLES],
        statuses=statuses,
        ids=ids if config.collect_ids else {},
    )


def _receive(out, children, timeout: float):
    """The next message from a client process; an error if they have all died first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            message = out.get(timeout=1.0)
        except queue.Empty:
            if all(not c.is_alive() for c in children) or time.monotonic() > deadline:
                codes = [c.exitcode for c in children]
                raise RuntimeError(
                    f"client processes gave no answer (exit codes {codes})"
                ) from None
            continue
        if isinstance(message, dict) and "crash" in message:
            raise RuntimeError(f"a client process failed: {message['crash']}")
        return message


# --- in a client process ----------------------------------------------------------------------


def _client_main(config: LoadConfig, agents: int, go, start_at, out) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops us; ^C is for the parent
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        out.put(run(_client(config, agents, go, start_at, out)))
    except BaseException as exc:
        out.put({"crash": repr(exc)})
        raise


class _Tally:
    """One process's counts and the measured window's latencies."""

    def __init__(self, measure_from: float, until: float):
        self.measure_from, self.until = measure_from, until
        self.latencies: dict[str, list[float]] = {e: [] for e in ENDPOINTS}
        self.requests = dict.fromkeys(ENDPOINTS, 0)
        self.ok = dict.fromkeys(ENDPOINTS, 0)
        self.errors = dict.fromkeys(ENDPOINTS, 0)
        self.episodes = 0
        self.error_samples: list[str] = []
        self.statuses: dict[str, int] = {}
        self.ids: dict[str, list[str]] = {"turn": [], "end": []}

    def measured(self, done: float) -> bool:
        return self.measure_from <= done <= self.until

    def add(self, endpoint: str, started: float, done: float, ok: bool, problem: str) -> None:
        if ok:
            self.ok[endpoint] += 1
            if self.measured(done):
                self.requests[endpoint] += 1
                self.latencies[endpoint].append(done - started)
            return
        self.errors[endpoint] += 1
        status = problem.split(" ", 1)[0] if problem[:1].isdigit() else "no answer"
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if len(self.error_samples) < ERROR_SAMPLES:
            self.error_samples.append(f"{endpoint}: {problem}")

    def as_dict(self) -> dict:
        return {
            "latencies": self.latencies,
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "episodes": self.episodes,
            "error_samples": self.error_samples,
            "statuses": self.statuses,
            "ids": self.ids,
        }


async def _client(config: LoadConfig, agents: int, go, start_at, out) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=agents, limit_per_host=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=config.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as http:
        out.put("ready")
        go.wait()  # blocks the loop, which has nothing to do yet
        t0 = start_at.value
        while time.monotonic() < t0:
            await asyncio.sleep(0.005)
        tally = _Tally(measure_from=t0 + config.warmup, until=t0 + config.warmup + config.duration)
        await asyncio.gather(*(_agent(http, config, tally) for _ in range(agents)))
    return tally.as_dict()


async def _agent(http, config: LoadConfig, tally: _Tally) -> None:
    """Episodes back to back until the cell's end; a failed call ends its episode."""
    base = config.base.rstrip("/")
    project = {"Authorization": f"Bearer {config.key}", "Content-Type": "application/json"}

    async def call(endpoint: str, path: str, headers: dict, body: bytes) -> bytes | None:
        started = time.monotonic()
        problem = ""
        try:
            async with http.post(base + path, data=body, headers=headers) as response:
                payload = await response.read()
                ok = 200 <= response.status < 300
                if not ok:
                    problem = f"{response.status} {payload[:200].decode(errors='replace')}"
        except Exception as exc:  # a refused or timed-out request is an error, not a crash
            payload, ok, problem = None, False, repr(exc)
        tally.add(endpoint, started, time.monotonic(), ok, problem)
        return payload if ok else None

    while time.monotonic() < tally.until:
        if await _episode(call, config, project, tally):
            tally.episodes += tally.measured(time.monotonic())
        else:
            await asyncio.sleep(0.05)  # do not spin on a failing target


async def _episode(call, config: LoadConfig, project: dict, tally: _Tally) -> bool:
    """One episode; True when every call of it was answered 2xx before the cell ended."""
    over = lambda: time.monotonic() >= tally.until  # noqa: E731
    headers = project
    if config.sessions:
        answer = await call("start", "/rl/start_session", project, START_BODY)
        if answer is None:
            return False
        key = json.loads(answer)["api_key"]
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    first = QUESTIONS[0]
    if config.distinct:  # this process's PID and its episode count: no two alike in the cell
        first = f"{first} (episode {os.getpid()}-{next(_EPISODES)})"
    messages = [{"role": "user", "content": first}]
    for turn in range(config.turns):
        if over():
            return False
        body = {"model": config.model, "messages": messages, "max_tokens": config.max_tokens}
        answer = await call("turn", "/chat/completions", headers, json.dumps(body).encode())
        if answer is None:
            return False
        completion = json.loads(answer)
        if config.collect_ids:
            tally.ids["turn"].append(completion["id"])
        reply = completion["choices"][0]["message"]
        messages = messages + [
            {"role": "assistant", "content": reply.get("content") or ""},
            {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]},
        ]
    if config.sessions:
        for endpoint, path, body in (
            ("reward", "/rl/set_reward", REWARD_BODY),
            ("end", "/rl/end_session", b""),
        ):
            answer = None if over() else await call(endpoint, path, headers, body)
            if answer is None:
                return False
            if endpoint == "end" and config.collect_ids:
                tally.ids["end"].append(json.loads(answer)["session_id"])
    return True


# --- cells and the report -----------------------------------------------------------------------

WORKLOADS = {
    "episodes": "start, k turns, reward, end",
    "turns": "k turns only (no /rl/*)",
    "completions": "one-turn completions, project key",
}
ROWS = {  # endpoint -> what Steep records for each acknowledged call of it
    "start": "sessions",
    "turn": "turn rows",
    "reward": "rewarded turns",
    "end": "ended sessions",
}


@dataclass
class SessionsCell:
    """One measured cell of a target: what the client saw and, for Steep, what it recorded."""

    target: str  # the target's label
    kind: str  # direct | steep | litellm
    workload: str  # a key of WORKLOADS
    load: LoadResult
    recorded: dict[str, int] | None = None  # endpoint -> rows written during the cell (Steep)
    workers: int = 1
    database: str = ""
    version: str = ""
    # CPU seconds the server's processes used over the whole cell (Steep on SQLite: all of its
    # work; on PostgreSQL the database's own processes are not counted)
    server_cpu_s: float | None = None
    round: int = 0  # which pass over the plan measured it (--rounds: cells interleaved)

    def mismatches(self) -> list[str]:
        """Where rows recorded and answers acknowledged differ (empty when they agree)."""
        if self.recorded is None:
            return []
        return [
            f"{endpoint}: {self.load.acknowledged.get(endpoint, 0)} acknowledged, {rows} {ROWS[endpoint]}"
            for endpoint, rows in self.recorded.items()
            if rows != self.load.acknowledged.get(endpoint, 0)
        ]

    def as_json(self) -> dict:
        r = self.load
        rates = {"episodes_per_s": r.episodes_per_s, "rps": r.rps()}
        rates["rps_by_endpoint"] = {e: r.rps(e) for e in r.requests}
        return asdict(self) | rates | {"mismatches": self.mismatches()}

    def line(self) -> str:
        r = self.load
        by = "  ".join(
            f"{e} {r.rps(e):.0f}/s p50 {r.p50_ms[e]:.1f} p99 {r.p99_ms[e]:.1f}" for e in r.requests
        )
        errors = sum(r.errors.values())
        check = (
            ""
            if self.recorded is None
            else (
                "  rows = acks"
                if not self.mismatches()
                else f"  ROWS DIFFER: {'; '.join(self.mismatches())}"
            )
        )
        return (
            f"{self.target:<28} {self.workload:<11} N={r.agents:<3} k={r.turns:<2} "
            f"{r.episodes_per_s:7.1f} ep/s {r.rps():7.0f} req/s  {by}  errors {errors}{check}"
        )


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _ms(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def report(cells: list[SessionsCell], *, verdict_agents: int, verdict_turns: int) -> str:
    """The markdown report: the table, rows recorded vs acknowledged, turns by target, verdicts."""
    rounds = len({c.round for c in cells}) > 1
    head = ["target", *(["round"] if rounds else []), "workload", "N", "k", "episodes/s", "req/s"]
    head += [f"{e} req/s" for e in ENDPOINTS] + [f"{e} p50/p99 ms" for e in ENDPOINTS]
    head += ["errors", "rows = acks"]
    out = [
        "| " + " | ".join(head) + " |",
        "|"
        + "|".join(["---"] * (3 if rounds else 2) + ["---:"] * (len(head) - (3 if rounds else 2)))
        + "|",
    ]
    for c in cells:
        r = c.load
        row = [c.target, *([str(c.round + 1)] if rounds else []), c.workload]
        row += [str(r.agents), str(r.turns)]
        row.append(_num(r.episodes_per_s) if c.workload != "completions" else "–")
        row.append(_num(r.rps()))
        row += [_num(r.rps(e)) if e in r.requests else "–" for e in ENDPOINTS]
        row += [
            f"{_ms(r.p50_ms[e])} / {_ms(r.p99_ms[e])}" if e in r.requests else "–"
            for e in ENDPOINTS
        ]
        errors = {e: n for e, n in r.errors.items() if n}
        row.append(", ".join(f"{e} {n}" for e, n in errors.items()) or "0")
        row.append("–" if c.recorded is None else ("yes" if not c.mismatches() else "**NO**"))
        out.append("| " + " | ".join(row) + " |")
    out.append("")

    recorded = [c for c in cells if c.recorded is not None]
    if recorded:
        out += ["Rows recorded / answers acknowledged (2xx), per cell, warm-up included:", ""]
        out.append(
            "| target | workload | N | k | "
            + " | ".join(f"{ROWS[e]} / {e} 2xx" for e in ENDPOINTS)
            + " |"
        )
        out.append("|---|---|---:|---:|" + "---:|" * len(ENDPOINTS))
        for c in recorded:
            r = c.load
            row = [c.target, c.workload, str(r.agents), str(r.turns)]
            for e in ENDPOINTS:
                if e in c.recorded:
                    mark = "" if c.recorded[e] == r.acknowledged.get(e, 0) else " **≠**"
                    row.append(f"{c.recorded[e]:,} / {r.acknowledged.get(e, 0):,}{mark}")
                else:
                    row.append("–")
            out.append("| " + " | ".join(row) + " |")
        out.append("")

    episodes = [c for c in cells if c.workload in ("episodes", "turns")]
    targets = list(dict.fromkeys(c.target for c in episodes))
    if len(targets) > 1:
        out += ["Chat turns by target (turn req/s, p50 / p99 ms):", ""]
        out.append("| N | k | " + " | ".join(targets) + " |")
        out.append("|---:|---:|" + "---:|" * len(targets))
        keys = list(dict.fromkeys((c.load.agents, c.load.turns) for c in episodes))
        for n, k in keys:
            row = [str(n), str(k)]
            for t in targets:
                c = next(
                    (
                        x
                        for x in episodes
                        if x.target == t and (x.load.agents, x.load.turns) == (n, k)
                    ),
                    None,
                )
                row.append(
                    f"{_num(c.load.rps('turn'))} ({_ms(c.load.p50_ms['turn'])} / {_ms(c.load.p99_ms['turn'])})"
                    if c and "turn" in c.load.requests
                    else "–"
                )
            out.append("| " + " | ".join(row) + " |")
        out.append("")

    if rounds:
        out += round_verdicts(cells, agents=verdict_agents, turns=verdict_turns)
    else:
        out += verdicts(cells, agents=verdict_agents, turns=verdict_turns)
    samples = [
        f"- {c.target}, N={c.load.agents} k={c.load.turns}: {s}"
        for c in cells
        for s in c.load.error_samples
    ]
    if samples:
        out += ["First errors seen:", "", *samples, ""]
    return "\n".join(out)


def _find(cells, kind: str, workload: str, agents: int, k: int, database: str = "", workers=1):
    """The first cell of ``kind``/``workload`` at ``agents`` and ``k`` (any database if empty)."""
    return next(
        (
            c
            for c in cells
            if c.kind == kind
            and c.workload == workload
            and (not database or c.database == database)
            and c.workers == workers
            and c.load.agents == agents
            and c.load.turns == k
        ),
        None,
    )


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def verdicts(cells: list[SessionsCell], *, agents: int, turns: int) -> list[str]:
    """The issue's goals, PASS or FAIL, for the cells this run measured."""

    def find(kind: str, workload: str, database: str = "", workers: int = 1, k: int = turns):
        return _find(cells, kind, workload, agents, k, database, workers)

    out = [f"**Goals ({agents} agents × {turns} turns, 1 web worker):**", ""]
    for database, floor in (("sqlite", 1000), ("postgres", 600)):
        c = find("steep", "episodes", database)
        if c is None:
            continue
        r = c.load
        worst = max(r.p99_ms.values())
        slowest = max(r.p99_ms, key=r.p99_ms.get)
        errors = sum(r.errors.values())
        out.append(
            f"- {c.target}: {_num(r.rps())} req/s mixed (≥ {floor:,}: {_mark(r.rps() >= floor)}); "
            f"worst p99 {_ms(worst)} ms, {slowest} (< 300 ms: {_mark(worst < 300)}); "
            f"{errors} errors ({_mark(errors == 0)}); rows = acks: "
            f"{_mark(not c.mismatches())}{'' if not c.mismatches() else ' (' + '; '.join(c.mismatches()) + ')'}"
        )
    for database in ("sqlite", "postgres"):
        c, base = find("steep", "episodes", database), find("steep", "completions", database, k=1)
        if c is None or base is None or not base.load.rps("turn"):
            continue
        one_turn = base.load.rps("turn")
        ratio = c.load.rps("turn") / one_turn
        longest = max(
            (x for x in cells if x.kind == "steep" and x.workload == "episodes" and x.database == database
             and x.workers == 1 and x.load.agents == agents),
            key=lambda x: x.load.turns,
        )  # fmt: skip
        out.append(
            f"- {c.target}, turns at k={turns} vs one-turn completions, {agents} agents, same client: "
            f"{_num(c.load.rps('turn'))} / {_num(one_turn)} req/s = {ratio:.0%} "
            f"(within 15%: {_mark(ratio >= 0.85)}). For reading it: the k={turns} mix's requests of "
            f"every kind, {_num(c.load.rps())} req/s = {c.load.rps() / one_turn:.0%} of the completions'; "
            f"at k={longest.load.turns}, turns {_num(longest.load.rps('turn'))} req/s = "
            f"{longest.load.rps('turn') / one_turn:.0%}"
        )
        single = find("steep", "episodes", database, k=1)
        measured = {x.load.turns for x in cells if x.kind == "steep" and x.workload == "episodes"}
        for k in sorted(measured - {1}, key=lambda k: (k != turns, k)):  # the goal's k first
            at_k = find("steep", "episodes", database, k=k)
            if single is not None and at_k is not None:
                stateless = find("steep", "turns", database, k=k)
                out += _turn_costs(at_k, single, base, stateless)
    ceiling = find("direct", "episodes")
    if ceiling:
        out.append(
            f"- Client ceiling (the same agent loop against the stand-in): {_num(ceiling.load.rps())} req/s, "
            f"{_num(ceiling.load.episodes_per_s)} episodes/s"
        )
    out.append("")
    return out


def goal_figures(cells: list[SessionsCell], *, agents: int, turns: int, database: str) -> dict:
    """The figures the goals judge, from one round's Steep cells on ``database``: the k-turn
    mix's req/s, worst p99, errors and rows; and per measured k > 1, a session turn's rate
    over a one-turn completion's from wall time (``_split_costs``) and from the server's CPU.
    Missing cells leave their figures out."""

    def find(workload: str, k: int):
        return _find(cells, "steep", workload, agents, k, database)

    out: dict = {}
    mix, base, single = find("episodes", turns), find("completions", 1), find("episodes", 1)
    if mix is not None:
        r = mix.load
        out.update(rps=r.rps(), p99=max(r.p99_ms.values()), errors=sum(r.errors.values()))
        out["rows_ok"] = not mix.mismatches()
    if base is None or single is None or not base.load.rps("turn"):
        return out
    out["completions_rps"] = base.load.rps("turn")
    one = 1 / base.load.rps("turn")
    ks = {c.load.turns for c in cells if c.kind == "steep" and c.workload == "episodes"}
    for k in sorted(ks - {1}):
        at_k = find("episodes", k)
        if at_k is None:
            continue
        r1, rk = single.load, at_k.load
        wall = _split_costs(one, r1.seconds, r1.requests, rk.seconds, rk.requests)
        if wall is not None:
            out[f"wall_k{k}"] = one / wall[1]
        cpu = _cpu_split(at_k, single, base)
        if cpu is not None:
            cpu_one, _, cpu_turn = cpu
            out[f"cpu_k{k}"] = cpu_one / cpu_turn
    return out


def round_verdicts(cells: list[SessionsCell], *, agents: int, turns: int) -> list[str]:
    """The goals judged on the median of each figure over the rounds (--rounds): each round
    measured every cell once, in the same order, so a ratio compares cells minutes apart at
    most, and the median leaves out a round the machine's drift spoiled."""
    rounds = sorted({c.round for c in cells})
    out = [
        f"**Goals over {len(rounds)} rounds ({agents} agents × {turns} turns, 1 web worker):**",
        "",
    ]
    for database, floor in (("sqlite", 1000), ("postgres", 600)):
        per_round = [
            goal_figures([c for c in cells if c.round == n], agents=agents, turns=turns,
                         database=database)
            for n in rounds
        ]  # fmt: skip
        per_round = [f for f in per_round if f]
        if not per_round:
            continue
        keys = [key for key in per_round[0] if key not in ("errors", "rows_ok")]
        out.append(f"| {database} round | " + " | ".join(_label(k) for k in keys) + " |")
        out.append("|---|" + "---:|" * len(keys))
        for n, figures in zip(rounds, per_round, strict=False):
            out.append(
                f"| {n + 1} | " + " | ".join(_figure(k, figures.get(k)) for k in keys) + " |"
            )
        median = {k: statistics.median(f[k] for f in per_round if k in f) for k in keys}
        out.append("| **median** | " + " | ".join(_figure(k, median[k]) for k in keys) + " |")
        out.append("")
        errors = sum(f.get("errors", 0) for f in per_round)
        rows_ok = all(f.get("rows_ok", True) for f in per_round)
        line = f"- {database}: median {_num(median.get('rps', 0))} req/s mixed (≥ {floor:,}: "
        line += f"{_mark(median.get('rps', 0) >= floor)}), {errors} errors in all rounds, rows = "
        line += f"acks in every round: {_mark(rows_ok)}"
        if "p99" in median:
            line += f"; median worst p99 {_ms(median['p99'])} ms (< 300 ms: {_mark(median['p99'] < 300)})"
        out.append(line)
        for key in keys:
            if key.startswith(("wall_k", "cpu_k")):
                out.append(
                    f"- {database}: {_label(key)}, median {median[key]:.0%} "
                    f"(within 15%: {_mark(median[key] >= 0.85)})"
                )
        out.append("")
    return out


_FIGURES = {"rps": "mixed req/s", "p99": "worst p99 ms", "completions_rps": "completions req/s"}


def _label(key: str) -> str:
    """A figure's column name: ``wall_k10`` -> "k=10 turn vs one-turn (wall)"."""
    if key in _FIGURES:
        return _FIGURES[key]
    source, _, k = key.partition("_k")
    return f"k={k} turn vs one-turn ({'wall' if source == 'wall' else 'CPU'})"


def _figure(key: str, value) -> str:
    if value is None:
        return "–"
    if key.startswith(("wall_k", "cpu_k")):
        return f"{value:.0%}"
    return _ms(value) if key == "p99" else _num(value)


def _turn_costs(episodes, single, base, stateless) -> list[str]:
    """What one chat turn of a session costs the server, from cells where it is saturated (the
    client's ceiling is several times higher), so each cell's seconds are the sum of its
    requests' costs. A one-turn completion costs 1 / its rate; a session's first turn costs
    what a one-turn completion does, so the k = 1 cell gives start/reward/end's cost; the
    k-turn cell then gives its turns' cost, from the requests of each kind the window held
    (agents in step hold more turns than k : 3 at some moments: the counts, not k, decide)."""
    one = 1 / base.load.rps("turn")
    costs = _split_costs(
        one, single.load.seconds, single.load.requests, episodes.load.seconds,
        episodes.load.requests,
    )  # fmt: skip
    if costs is None:
        return []
    control, turn = costs
    k = episodes.load.turns
    lines = [
        f"- {episodes.target}, a session's chat turn at k={k} (the window's seconds less its "
        f"start/reward/end, {1000 * control:.2f} ms each from k=1, over its turns): "
        f"{1000 * turn:.2f} ms = {_num(1 / turn)} turns/s vs {_num(1 / one)} one-turn "
        f"completions/s = {one / turn:.0%} (within 15%: {_mark(one / turn >= 0.85)})"
    ]
    cpu = _cpu_turn_costs(episodes, single, base, stateless)
    if cpu:
        lines.append(f"- {episodes.target}, the same from the server's CPU time: {cpu}")
    if stateless is not None and stateless.load.rps("turn"):
        # The same conversations, each turn a one-turn completion re-sending the history:
        # what a turn costs when it carries what a session's turn carries, without the
        # session (its lookup, prefix reuse and bookkeeping).
        alike = 1 / stateless.load.rps("turn")
        lines.append(
            f"- {episodes.target}, the same turns as one-turn completions re-sending the "
            f"history (k={k}, no session): {1000 * alike:.2f} ms = {_num(1 / alike)} turns/s; "
            f"a session's turn runs at {alike / turn:.0%} of that"
        )
    return lines


def _split_costs(one: float, total_1: float, counts_1: dict, total_k: float, counts_k: dict):
    """(start/reward/end's cost, a turn's cost) from two cells' totals (seconds or CPU
    seconds) and request counts, a one-turn completion costing ``one``: the k = 1 cell, whose
    turns cost ``one`` each, gives the control requests' cost; the k cell, less its controls at
    that cost, gives its turns'. None when a cell lacks the requests it divides by, or the
    totals are not the sums of costs the split assumes (a cost at or below zero)."""
    controls = sum(n for e, n in counts_1.items() if e != "turn")
    if not controls or not counts_k.get("turn"):
        return None
    control = (total_1 - counts_1.get("turn", 0) * one) / controls
    spent = total_k - control * sum(n for e, n in counts_k.items() if e != "turn")
    if control <= 0 or spent <= 0:
        return None
    return control, spent / counts_k["turn"]


def _cpu_split(episodes, single, base):
    """(a one-turn completion's, start/reward/end's, a session turn's) server CPU seconds,
    from the cells' CPU over their acknowledged requests (``_split_costs``); None when a
    cell has no CPU figure or the split fails."""
    cells = (episodes, single, base)
    if any(c.server_cpu_s is None for c in cells) or not base.load.acknowledged.get("turn"):
        return None
    one = base.server_cpu_s / base.load.acknowledged["turn"]
    costs = _split_costs(
        one, single.server_cpu_s, single.load.acknowledged, episodes.server_cpu_s,
        episodes.load.acknowledged,
    )  # fmt: skip
    return None if costs is None else (one, *costs)


def _cpu_turn_costs(episodes, single, base, stateless) -> str:
    """``_turn_costs`` from the server's CPU seconds per acknowledged request of each kind
    over whole cells instead of the window's wall seconds: what the server itself spends,
    without the client's and the stand-in's share of the same cores (which grows with the
    conversation's length too). Empty when a cell has no CPU figure."""
    costs = _cpu_split(episodes, single, base)
    if costs is None:
        return ""
    one, control, turn = costs
    text = (
        f"{1000 * one:.3f} ms per one-turn completion, {1000 * control:.3f} ms per "
        f"start/reward/end, {1000 * turn:.3f} ms per session turn at k={episodes.load.turns}: "
        f"{one / turn:.0%} of a completion's rate"
    )
    if stateless is not None and stateless.server_cpu_s and stateless.load.acknowledged.get("turn"):
        alike = stateless.server_cpu_s / stateless.load.acknowledged["turn"]
        text += (
            f"; {1000 * alike:.3f} ms per stateless turn (session turn at {alike / turn:.0%} of it)"
        )
    return text
