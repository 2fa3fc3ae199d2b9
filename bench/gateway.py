"""Gateway benchmark (issues #4 and #11): Steep's gateway against LiteLLM's proxy and SGLang's router.

Every target sits in front of the same zero-latency engine stand-in
(``bench/standin.py``) on 127.0.0.1, and is driven by Debian's ``wrk`` (one
thread, a Lua script for the POST body, ``--latency``) at 1, 16 and 64
connections. The targets:

- ``direct``: the stand-in's ``/v1/chat/completions`` itself (the machine's floor);
- ``steep``: ``uvicorn webapp.asgi:application`` with 1 and 2 workers, on the
  embedded SQLite default and on PostgreSQL + Redis; wrk POSTs
  ``/agents/{agent}/v1/chat/completions`` with the project key, so every request
  opens a one-turn session and records it durably (Session + Interaction rows:
  prompt ids, output ids, logprobs, versions) before it answers;
- ``litellm``: ``litellm --config`` (1 and 2 workers), model ``policy`` routed to
  ``openai/policy`` at the stand-in, in its own venv;
- ``sglang-router``: ``python -m sglang_router.launch_router`` (round robin), in its own venv.

Added latency is the target's p50 minus the direct p50 at one connection.

``--workload sessions`` measures what agents do instead (issue #11): N agents (1, 64, 200)
each looping ``/rl/start_session`` -> k chat turns with the session key (1, 3, 10; the
conversation grows) -> ``/rl/set_reward`` -> ``/rl/end_session``, driven by the aiohttp
client of ``bench/sessions_load.py`` in several processes. Targets: ``direct`` (the same
loop against the stand-in: the client's own ceiling), ``steep`` (and, at each N, one-turn
completions with the project key through the same client, to compare turns with), and
``litellm`` (only the k turns: it has no session endpoints). After each Steep cell the
rows written are counted against the answers acknowledged.

    .venv/bin/python bench/gateway.py                     # everything, ~7 minutes
    .venv/bin/python bench/gateway.py --targets direct,steep --database sqlite --duration 5
    .venv/bin/python bench/gateway.py --workload sessions      # agents' episodes, ~10 minutes
    .venv/bin/python bench/gateway.py --workload ttft          # streaming: time to first token

``--workload ttft`` (issue #15, ``bench/ttft.py``): the stand-in takes ``--token-delay-ms`` per
token and streams; time to first token and completions/s through Steep (streamed and not)
against the stand-in's own streamed ``/generate``, at 1 and 64 clients.

The peers' venvs are created under ``.steep/bench-venvs/`` on first use (idempotent);
each run's files (databases, logs, wrk scripts, results.json) go to
``.steep/bench/gateway-<time>/`` (``gateway-sessions-<time>/``). Everything started is stopped at the end.
See docs/benchmarks/gateway.md for the results and how to read them.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import sessions_load, ttft  # noqa: E402
from bench.sessions_load import LoadConfig, SessionsCell, run_load  # noqa: E402
from tests.livestack import LiveStack, answers, free_port, run_checked, steep_env  # noqa: E402

STEEP_PYTHON = ROOT / ".venv" / "bin" / "python"
VENVS = ROOT / ".steep" / "bench-venvs"
RUNS = ROOT / ".steep" / "bench"

# litellm 1.107.0 was a compromised release (it is no longer on PyPI); stay on the 1.106 line,
# the version BENCH-PEERS.md was measured with.
LITELLM_SPEC = os.environ.get("BENCH_LITELLM_SPEC", "litellm[proxy]>=1.106,<1.107")
SGLANG_ROUTER_SPEC = os.environ.get("BENCH_SGLANG_ROUTER_SPEC", "sglang-router==0.3.2")

CHAT_BODY = {
    "model": "policy",
    "messages": [{"role": "user", "content": "What is 2+2?"}],
    "max_tokens": 8,
}
PG_URL = "postgres://postgres@127.0.0.1:5432/steep_bench"
REDIS_URL = "redis://127.0.0.1:6379/4"
LITELLM_KEY = "sk-bench-litellm"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- HTTP (the processes: tests/livestack.py) ------------------------------------------------


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None, timeout=5.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, resp.read()


# --- peers' venvs ---------------------------------------------------------------------------


def ensure_venv(name: str, spec: str) -> Path:
    """``.steep/bench-venvs/NAME`` with ``spec`` installed; reused when its marker matches."""
    venv = VENVS / name
    marker = venv / ".bench-installed"
    if (
        marker.exists()
        and marker.read_text().strip() == spec
        and (venv / "bin" / "python").exists()
    ):
        return venv
    log(f"installing {spec} into {venv.relative_to(ROOT)} (first use; a minute or two)")
    base = getattr(sys, "_base_executable", None) or sys.executable
    if not (venv / "bin" / "python").exists():
        run_checked([base, "-m", "venv", str(venv)], what=f"python -m venv {venv}")
    run_checked(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            spec,
        ],
        what=f"pip install {spec}",
    )
    marker.write_text(spec + "\n")
    return venv


def pip_version(venv: Path, dist: str) -> str:
    out = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            f"import importlib.metadata as m; print(m.version({dist!r}))",
        ],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "?"


# --- wrk ------------------------------------------------------------------------------------

WRK_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests": %d, "duration_us": %d, "bytes": %d, "p50_us": %d, "p90_us": %d, ' ..
    '"p99_us": %d, "mean_us": %.1f, "max_us": %d, "err_connect": %d, "err_read": %d, ' ..
    '"err_write": %d, "err_status": %d, "err_timeout": %d}\n',
    summary.requests, summary.duration, summary.bytes, latency:percentile(50),
    latency:percentile(90), latency:percentile(99), latency.mean, latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (Linux ``/proc``)."""
    parents, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        child = int(stat.parent.name)
        parents[child], ticks[child] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, frontier = {pid}, [pid]
    while frontier:
        frontier = [c for c, p in parents.items() if p in frontier and c not in tree]
        tree.update(frontier)
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def lua_quote(text: str) -> str:
    return json.dumps(text)  # a JSON string of ASCII text is a valid Lua string literal


def write_lua(path: Path, headers: dict[str, str]) -> Path:
    lines = ['wrk.method = "POST"', f"wrk.body = {lua_quote(json.dumps(CHAT_BODY))}"]
    lines.append('wrk.headers["Content-Type"] = "application/json"')
    for key, value in headers.items():
        lines.append(f"wrk.headers[{lua_quote(key)}] = {lua_quote(value)}")
    path.write_text("\n".join(lines) + "\n" + WRK_DONE)
    return path


@dataclass
class Cell:
    conns: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int  # non-2xx/3xx + socket errors
    detail: dict = field(default_factory=dict)


def wrk(url: str, lua: Path, conns: int, seconds: float) -> dict:
    cmd = [
        "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
        "--latency", "-s", str(lua), url,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    for line in result.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return json.loads(line[len("BENCH_JSON ") :])
    raise RuntimeError(f"wrk printed no result:\n{result.stdout}\n{result.stderr}")


def measure(url: str, lua: Path, conns: int, duration: float, warmup: float) -> Cell:
    if warmup > 0:
        wrk(url, lua, conns, warmup)
    raw = wrk(url, lua, conns, duration)
    seconds = raw["duration_us"] / 1e6
    errors = sum(
        raw[k] for k in ("err_connect", "err_read", "err_write", "err_status", "err_timeout")
    )
    return Cell(
        conns=conns,
        rps=raw["requests"] / seconds if seconds else 0.0,
        p50_ms=raw["p50_us"] / 1000,
        p99_ms=raw["p99_us"] / 1000,
        requests=raw["requests"],
        errors=errors,
        detail=raw,
    )


# --- targets --------------------------------------------------------------------------------


@dataclass
class Result:
    target: str  # the row label
    kind: str  # direct | steep | litellm | sglang-router
    cells: list[Cell]
    notes: list[str] = field(default_factory=list)
    version: str = ""
    workers: int = 1
    database: str = ""


@dataclass
class SteepServer:
    name: str  # its log's name
    label: str  # the report's row label
    proc: subprocess.Popen
    env: dict  # for manage.py against its database
    key: str  # the project key
    base: str  # the agent's base_url: .../agents/{id}/v1
    data_dir: Path


@dataclass
class PeerServer:
    name: str
    label: str
    base: str  # .../v1
    key: str
    venv: Path


class Bench:
    def __init__(self, args, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.standin_port = 0
        self.results: list[Result] = []
        self.sessions: list[SessionsCell] = []  # --workload sessions
        self.processes = LiveStack(log_dir=self.logs, python=STEEP_PYTHON)

    def wait_ready(self, proc, url: str, *, what: str, timeout: float, body=None, headers=None):
        self.processes.wait_ready(
            proc, lambda: answers(url, body=body, headers=headers), what=what, timeout=timeout
        )

    # stand-in
    def start_standin(self) -> None:
        self.standin_port = free_port()
        command = [str(STEEP_PYTHON), "bench/standin.py", "--port", str(self.standin_port)]
        if self.args.workload == "ttft":
            command += ["--tokens", str(self.args.tokens)]
            command += ["--token-delay-ms", str(self.args.token_delay_ms)]
        proc = self.processes.start("standin", command)
        self.standin_pid = proc.pid
        self.wait_ready(proc, f"{self.standin_url}/health", what="stand-in", timeout=30)

    @property
    def standin_url(self) -> str:
        return f"http://127.0.0.1:{self.standin_port}"

    def sweep(self, label: str, kind: str, url: str, lua: Path, **extra) -> Result:
        cells = []
        for conns in self.args.conns:
            cell = measure(url, lua, conns, self.args.duration, self.args.warmup)
            log(
                f"  {label:<28} c={conns:<3} {cell.rps:>9.0f} req/s  p50 {cell.p50_ms:8.3f} ms"
                f"  p99 {cell.p99_ms:8.3f} ms  errors {cell.errors}"
            )
            cells.append(cell)
        result = Result(target=label, kind=kind, cells=cells, **extra)
        self.results.append(result)
        return result

    def direct(self) -> None:
        lua = write_lua(self.workdir / "direct.lua", {})
        self.sweep("stand-in, direct", "direct", f"{self.standin_url}/v1/chat/completions", lua)

    # --- Steep
    def fresh_postgres(self) -> None:
        from urllib.parse import urlparse

        url = urlparse(self.args.postgres_url)
        name = url.path.lstrip("/")
        admin = url._replace(path="/postgres").geturl()
        code = textwrap.dedent(
            f"""
            import psycopg
            with psycopg.connect({admin!r}, autocommit=True) as c:
                c.execute('DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                c.execute('CREATE DATABASE "{name}"')
            """
        )
        run_checked([str(STEEP_PYTHON), "-c", code], what=f"recreating database {name}")
        code = textwrap.dedent(
            f"""
            import redis
            redis.Redis.from_url({self.args.redis_url!r}).flushdb()
            """
        )
        run_checked([str(STEEP_PYTHON), "-c", code], what="flushing the bench redis db")

    def steep_setup(self, database: str, workers: int, port: int) -> tuple[dict, str, str, Path]:
        """A fresh DATA_DIR (and database): migrations, key, online run, agent, attached stand-in."""
        data_dir = self.workdir / f"steep-{database}-w{workers}"
        if data_dir.exists():
            shutil.rmtree(data_dir)
        data_dir.mkdir(parents=True)
        postgres = database == "postgres"
        env = steep_env(
            data_dir=data_dir,
            database_url=self.args.postgres_url if postgres else "",
            redis_url=self.args.redis_url if postgres else "",
            site_url=f"http://127.0.0.1:{port}",
            DEBUG="false",
            SECRET_KEY="bench-gateway-not-a-secret-" + "x" * 32,
            ALLOWED_HOSTS="127.0.0.1,localhost",
            LOG_LEVEL="WARNING",
            STEEP_MODEL_ROOTS=str(self.workdir),  # the tiny model below is the run's base model
        )
        if database == "postgres":
            self.fresh_postgres()
        manage = [str(STEEP_PYTHON), "manage.py"]
        run_checked(manage + ["migrate", "--noinput", "-v0"], env=env, what="migrate")
        model = self.workdir / "tiny-model"
        if not (model / "tokenizer.json").exists():
            run_checked([str(STEEP_PYTHON), "-m", "rl_core.tiny", str(model)], what="rl_core.tiny")
        out = run_checked(
            manage + ["create_api_key", "--project", "bench"], env=env, what="create_api_key"
        )
        key = out.strip().splitlines()[-1].strip()
        code = textwrap.dedent(
            f"""
            from rl_core.config import RunConfig
            from webapp.accounts.models import Project
            from webapp.agents.services import agent_create
            from webapp.runs.services import run_create
            project = Project.objects.get(name="bench")
            config = RunConfig.from_dict({{"mode": "online", "base_model": {str(model)!r},
                                          "max_staleness": 1000000, "batch_size": 1000}})
            run = run_create(project=project, name="gateway bench", config=config)
            agent = agent_create(project=project, name="bench agent", run=run)
            print("IDS", run.id, agent.id)
            """
        )
        out = run_checked(
            manage + ["shell", "-c", code], env=env, what="creating the run and agent"
        )
        ids = [line for line in out.splitlines() if line.startswith("IDS ")][-1].split()
        run_id, agent_id = ids[1], ids[2]
        run_checked(
            manage + ["attach_inference_server", "--run", run_id, "--url", self.standin_url],
            env=env,
            what="attach_inference_server",
        )
        return env, key, agent_id, data_dir

    def steep_counts(self, env: dict) -> dict:
        """Rows in the bench database: all sessions and interactions, and those of multi-turn
        sessions (``/rl/start_session``) and one-turn ones (project-key completions) apart."""
        code = textwrap.dedent(
            """
            import json
            from webapp.gateway.models import Interaction, Session
            multi = Session.objects.filter(one_turn=False)
            turns = Interaction.objects.filter(session__one_turn=False)
            print("COUNTS", json.dumps({
                "sessions": Session.objects.count(),
                "interactions": Interaction.objects.count(),
                "multi_sessions": multi.count(),
                "multi_ended": multi.filter(status=Session.Status.ENDED).count(),
                "multi_interactions": turns.count(),
                "multi_rewarded": turns.filter(reward__isnull=False).count(),
                "one_turn_sessions": Session.objects.filter(one_turn=True).count(),
                "one_turn_interactions": Interaction.objects.filter(session__one_turn=True).count(),
            }))
            """
        )
        out = run_checked(
            [str(STEEP_PYTHON), "manage.py", "shell", "-c", code], env=env, what="count rows"
        )
        line = [x for x in out.splitlines() if x.startswith("COUNTS ")][-1]
        return json.loads(line[len("COUNTS ") :])

    @contextlib.contextmanager
    def steep_server(self, database: str, workers: int) -> Iterator[SteepServer]:
        """A fresh Steep (``steep_setup``) served by uvicorn, warmed up; stopped on exit."""
        port = free_port()
        env, key, agent_id, data_dir = self.steep_setup(database, workers, port)
        name = f"steep-{database}-w{workers}"
        proc = self.processes.start_web(port, name=name, workers=workers, access_log=False, env=env)
        base = f"http://127.0.0.1:{port}/agents/{agent_id}/v1"
        url = f"{base}/chat/completions"
        headers = {"Authorization": f"Bearer {key}"}
        try:
            self.wait_ready(proc, url, body=CHAT_BODY, headers=headers, what=name, timeout=60)
            if workers > 1:  # every worker loads its tokenizer on its first request
                for _ in range(4 * workers):
                    http("POST", url, CHAT_BODY, headers)
            label = f"Steep, {'SQLite' if database == 'sqlite' else 'Postgres+Redis'}, {workers} worker{'s' if workers > 1 else ''}"
            yield SteepServer(name, label, proc, env, key, base, data_dir)
        finally:
            self.processes.stop(proc, timeout=10.0)

    def steep(self, database: str, workers: int) -> None:
        with self.steep_server(database, workers) as server:
            url = f"{server.base}/chat/completions"
            lua = write_lua(
                self.workdir / f"{server.name}.lua", {"Authorization": f"Bearer {server.key}"}
            )
            result = self.sweep(server.label, "steep", url, lua, workers=workers, database=database)
            if self.args.profile:
                self.profile(server.proc, url, lua, server.name)
        counts = self.steep_counts(server.env)
        ok = sum(c.requests - c.detail["err_status"] for c in result.cells)
        result.notes.append(
            f"{counts['interactions']} interactions / {counts['sessions']} sessions recorded "
            f"(measured cells: {ok} successful responses; the rest are warm-up)"
        )
        if database == "sqlite":
            size = sum(p.stat().st_size for p in server.data_dir.glob("steep.sqlite3*"))
            result.notes.append(f"database {size / 1e6:.0f} MB")
        log(f"  {result.notes[-1] if database == 'postgres' else '; '.join(result.notes)}")

    def profile(self, proc, url: str, lua: Path, name: str) -> None:
        """py-spy the server (all workers) under load at the largest connection count; not measured."""
        self.spy(proc, name, lambda seconds: wrk(url, lua, max(self.args.conns), seconds))

    def spy(self, proc, name: str, load: Callable[[float], object]) -> None:
        """py-spy ``proc`` (all workers) while ``load(seconds)`` runs; not measured."""
        pyspy = ROOT / ".venv" / "bin" / "py-spy"
        if not pyspy.exists():
            pyspy = Path(shutil.which("py-spy") or pyspy)
        if not pyspy.exists():
            log("  (no py-spy; skipping the profile)")
            return
        seconds = max(5, round(self.args.duration))
        out = self.workdir / f"profile-{name}.txt"
        spy = subprocess.Popen(
            [str(pyspy), "record", "--pid", str(proc.pid), "--subprocesses", "--duration",
             str(seconds), "--rate", "250", "--format", "raw", "--output", str(out), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1)
        load(seconds)
        spy.wait(60)
        log(f"  profile (collapsed stacks) -> {out.relative_to(ROOT)}")

    # --- LiteLLM
    @contextlib.contextmanager
    def litellm_server(self, workers: int) -> Iterator[PeerServer]:
        """LiteLLM's proxy in front of the stand-in, warmed up; stopped on exit."""
        venv = ensure_venv("litellm", LITELLM_SPEC)
        port = free_port()
        home = self.workdir / f"litellm-w{workers}"
        home.mkdir(exist_ok=True)
        config = home / "config.yaml"
        config.write_text(
            textwrap.dedent(
                f"""\
                model_list:
                  - model_name: policy
                    litellm_params:
                      model: openai/policy
                      api_base: {self.standin_url}/v1
                      api_key: standin
                """
            )
        )
        # Per-request access logging off, as for Steep (--no-access-log) and the router (--log-level warn).
        log_config = home / "log.json"
        log_config.write_text(
            json.dumps(
                {
                    "version": 1,
                    "disable_existing_loggers": False,
                    "formatters": {
                        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}
                    },
                    "handlers": {
                        "stderr": {"class": "logging.StreamHandler", "formatter": "plain"}
                    },
                    "loggers": {
                        "uvicorn": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
                        "uvicorn.error": {"level": "WARNING"},
                        "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
                    },
                }
            )
        )
        env = dict(os.environ)
        for k in ("DATABASE_URL", "REDIS_URL"):
            env.pop(k, None)
        env.update(
            LITELLM_MASTER_KEY=LITELLM_KEY,
            LITELLM_LOCAL_MODEL_COST_MAP="True",
            LITELLM_LOG="WARNING",
            HOME=str(home),
        )
        cmd = [
            str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--num_workers", str(workers), "--log_config", str(log_config),
        ]  # fmt: skip
        name = f"litellm-w{workers}"
        proc = self.processes.start(name, cmd, env=env, cwd=home)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
        try:
            self.wait_ready(proc, url, body=CHAT_BODY, headers=headers, what=name, timeout=180)
            for _ in range(4 * workers):
                http("POST", url, CHAT_BODY, headers, timeout=30)
            label = f"LiteLLM proxy, {workers} worker{'s' if workers > 1 else ''}"
            yield PeerServer(name, label, f"http://127.0.0.1:{port}/v1", LITELLM_KEY, venv)
        finally:
            self.processes.stop(proc, timeout=10.0)

    def litellm(self, workers: int) -> None:
        with self.litellm_server(workers) as server:
            lua = write_lua(
                self.workdir / f"{server.name}.lua", {"Authorization": f"Bearer {server.key}"}
            )
            self.sweep(
                server.label,
                "litellm",
                f"{server.base}/chat/completions",
                lua,
                workers=workers,
                version=pip_version(server.venv, "litellm"),
            )

    # --- sglang-router
    def sglang_router(self) -> None:
        venv = ensure_venv("sglang-router", SGLANG_ROUTER_SPEC)
        port, prom = free_port(), free_port()
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = [
            str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", self.standin_url, "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--log-level", "warn",
        ]  # fmt: skip
        proc = self.processes.start("sglang-router", cmd, env=env)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            self.wait_ready(proc, url, body=CHAT_BODY, what="sglang-router", timeout=60)
            lua = write_lua(self.workdir / "sglang-router.lua", {})
            self.sweep(
                "sglang-router, round_robin",
                "sglang-router",
                url,
                lua,
                version=pip_version(venv, "sglang-router"),
            )
        finally:
            self.processes.stop(proc, timeout=10.0)

    # --- the sessions workload (bench/sessions_load.py)
    def agent_loop(
        self, label: str, kind: str, base: str, key: str, plan, counts=None, cpu_pid=None, **extra
    ):
        """Measure each ``(workload, agents, turns)`` of ``plan`` against ``base``; with
        ``counts`` (a function returning ``steep_counts``), the rows each cell wrote; with
        ``cpu_pid``, the CPU seconds that process and its children used in each cell."""
        last = counts() if counts else None
        for n, workload, agents, turns in plan:
            config = LoadConfig(
                base=base,
                key=key,
                agents=agents,
                turns=turns,
                duration=self.args.duration,
                warmup=self.args.warmup,
                procs=self.args.client_procs,
                distinct=self.args.distinct_conversations,
                sessions=workload == "episodes",
            )
            before = tree_cpu_seconds(cpu_pid) if cpu_pid else None
            cell = SessionsCell(label, kind, workload, run_load(config), round=n, **extra)
            if before is not None:
                cell.server_cpu_s = tree_cpu_seconds(cpu_pid) - before
            if counts:
                now = counts()
                delta = {name: now[name] - last[name] for name in now}
                last = now
                cell.recorded = (
                    {
                        "start": delta["multi_sessions"],
                        "turn": delta["multi_interactions"],
                        "reward": delta["multi_rewarded"],
                        "end": delta["multi_ended"],
                    }
                    if workload == "episodes"
                    else {"turn": delta["one_turn_interactions"]}
                )
                if (
                    workload == "completions"
                    and delta["one_turn_sessions"] != delta["one_turn_interactions"]
                ):
                    cell.recorded["start"] = delta["one_turn_sessions"]  # shows as a difference
            log(f"  {cell.line()}")
            self.sessions.append(cell)

    def plan(
        self, workload: str, *, baseline: bool = False, stateless: bool = False
    ) -> list[tuple[int, str, int, int]]:
        """Every (round, workload, agents, turns) cell; with ``baseline``, one-turn completions
        first at each N; with ``stateless``, also the same conversations as one-turn
        completions (``turns``, k > 1: each request re-sends the history, as to a peer without
        sessions). With ``--rounds``, Steep's cells are measured that many times over,
        interleaved (all of round 1, then all of round 2, ...)."""
        cells = []
        for n in range(self.args.rounds if baseline else 1):
            for agents in self.args.agents:
                if baseline:
                    cells.append((n, "completions", agents, 1))
                cells += [(n, workload, agents, k) for k in self.args.turns]
                if stateless:
                    cells += [(n, "turns", agents, k) for k in self.args.turns if k > 1]
        return cells

    def direct_sessions(self) -> None:
        self.agent_loop(
            "client ceiling (stand-in)",
            "direct",
            f"{self.standin_url}/v1",
            "standin",
            self.plan("episodes"),
        )

    def steep_sessions(self, database: str, workers: int) -> None:
        """Steep's cells; with ``--fresh-database`` each on a Steep set up anew (migrations,
        key, run, agent), so no cell runs on the rows the cells before it wrote."""
        plan = self.plan("episodes", baseline=True, stateless=True)
        groups = [[cell] for cell in plan] if self.args.fresh_database else [plan]
        for number, cells in enumerate(groups, 1):
            with self.steep_server(database, workers) as server:
                self.agent_loop(
                    server.label,
                    "steep",
                    server.base,
                    server.key,
                    cells,
                    counts=lambda server=server: self.steep_counts(server.env),
                    cpu_pid=server.proc.pid,
                    workers=workers,
                    database=database,
                )
                if self.args.profile and number == len(groups):
                    for turns in sorted({min(self.args.turns), max(self.args.turns)}):
                        self.spy(
                            server.proc,
                            f"{server.name}-episodes-k{turns}",
                            lambda seconds, k=turns: self.unmeasured_load(server, k, seconds),
                        )

    def unmeasured_load(self, server: SteepServer, turns: int, seconds: float) -> None:
        """The largest N's episodes at ``turns`` for ``seconds``, results discarded (profiling)."""
        run_load(
            LoadConfig(
                base=server.base,
                key=server.key,
                agents=max(self.args.agents),
                turns=turns,
                duration=seconds,
                warmup=0,
                procs=self.args.client_procs,
                distinct=self.args.distinct_conversations,
                sessions=True,
            )
        )

    def litellm_sessions(self, workers: int) -> None:
        with self.litellm_server(workers) as server:
            version = pip_version(server.venv, "litellm")
            label = f"{server.label} ({version})"
            self.agent_loop(
                label,
                "litellm",
                server.base,
                server.key,
                self.plan("turns"),
                workers=workers,
                version=version,
            )


# --- report ---------------------------------------------------------------------------------


def fmt_rps(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def fmt_ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def report(results: list[Result], conns: list[int], meta: dict) -> str:
    lines = []
    head = ["target"]
    for c in conns:
        tag = f"{c} conn" + ("s" if c > 1 else "")
        head += [f"{tag}: req/s", "p50 ms", "p99 ms"]
    head += ["errors"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for r in results:
        row = [r.target + (f" ({r.version})" if r.version else "")]
        by = {c.conns: c for c in r.cells}
        for c in conns:
            cell = by.get(c)
            row += (
                [fmt_rps(cell.rps), fmt_ms(cell.p50_ms), fmt_ms(cell.p99_ms)] if cell else ["–"] * 3
            )
        row.append(str(sum(c.errors for c in r.cells)))
        lines.append("| " + " | ".join(row) + " |")

    direct = next((r for r in results if r.kind == "direct"), None)
    lo, hi = min(conns), max(conns)

    def cell(r: Result, c: int) -> Cell | None:
        return next((x for x in r.cells if x.conns == c), None)

    out = ["\n".join(lines), ""]
    if direct and cell(direct, lo):
        base = cell(direct, lo).p50_ms
        out.append(
            f"Added latency at p50, {lo} connection{'s' if lo > 1 else ''} (target p50 − direct p50 {fmt_ms(base)} ms):"
        )
        out.append("")
        for r in results:
            if r is direct or not cell(r, lo):
                continue
            out.append(f"- {r.target}: {cell(r, lo).p50_ms - base:+.3f} ms")
        out.append("")

    verdicts = []
    steeps = [r for r in results if r.kind == "steep"]
    litellms = [r for r in results if r.kind == "litellm"]
    if steeps and litellms and hi in conns:
        verdicts.append(f"**Throughput, {hi} connections: Steep ≥ 10× LiteLLM?**")
        verdicts.append("")
        for s in steeps:
            peer = next((x for x in litellms if x.workers == s.workers), None) or max(
                litellms, key=lambda x: cell(x, hi).rps if cell(x, hi) else 0
            )
            sc, lc = cell(s, hi), cell(peer, hi)
            if sc and lc and lc.rps > 0:
                ratio = sc.rps / lc.rps
                verdicts.append(
                    f"- {s.target} vs {peer.target}: {fmt_rps(sc.rps)} / {fmt_rps(lc.rps)} req/s = "
                    f"**{ratio:.1f}×** → {'PASS' if ratio >= 10 and sc.errors == 0 else 'FAIL'}"
                )
        verdicts.append("")
    if steeps and direct and cell(direct, lo):
        base = cell(direct, lo).p50_ms
        verdicts.append(f"**Added latency at p50, {lo} client: Steep < 2 ms?**")
        verdicts.append("")
        for s in steeps:
            if cell(s, lo):
                added = cell(s, lo).p50_ms - base
                verdicts.append(
                    f"- {s.target}: {added:.3f} ms → {'PASS' if added < 2.0 else 'FAIL'}"
                )
        verdicts.append("")
    out += verdicts
    notes = [f"- {r.target}: {n}" for r in results for n in r.notes]
    if notes:
        out += ["Recorded by Steep:", "", *notes, ""]
    return "\n".join(out)


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split(
            "\n"
        )[0]
    except OSError:
        wrk_version = "?"
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "wrk": wrk_version.strip(),
        "loadavg_before": os.getloadavg(),
    }


# --- main -----------------------------------------------------------------------------------


WORKLOAD_DEFAULTS = {  # what an option left out means, by workload
    "completions": dict(
        duration=10,
        warmup=3,
        targets="direct,steep,litellm,sglang-router",
        steep_workers="1,2",
        litellm_workers="1,2",
    ),
    "sessions": dict(
        duration=8, warmup=2, targets="direct,steep,litellm", steep_workers="1", litellm_workers="1"
    ),
    "ttft": dict(
        duration=5,
        warmup=1,
        targets="direct,steep",
        steep_workers="1",
        litellm_workers="1",
        conns="1,64",
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Steep gateway benchmark (issues #4 and #11).")
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOAD_DEFAULTS),
        default="completions",
        help="completions: one-turn completions driven by wrk (default); sessions: agents "
        "looping start_session, k turns, set_reward, end_session (bench/sessions_load.py)",
    )
    p.add_argument(
        "--duration", type=float, help="seconds measured per cell (default 10; sessions 8)"
    )
    p.add_argument(
        "--warmup",
        type=float,
        help="seconds of unmeasured load before each cell (default 3; sessions 2)",
    )
    p.add_argument("--conns", help="connection counts (default 1,16,64; ttft 1,64)")
    p.add_argument("--tokens", type=int, default=32, help="ttft: tokens per answer (default 32)")
    p.add_argument(
        "--token-delay-ms",
        type=float,
        default=5.0,
        help="ttft: the stand-in's time per token (default 5)",
    )
    p.add_argument(
        "--agents", default="1,64,200", help="sessions: agents at once (default 1,64,200)"
    )
    p.add_argument("--turns", default="1,3,10", help="sessions: turns per episode (default 1,3,10)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="sessions: measure Steep's cells this many times, interleaved, and judge the goals "
        "on the medians over the rounds (default 1)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=2,
        help="sessions: client processes the agents are split over (default 2)",
    )
    p.add_argument(
        "--distinct-conversations",
        action="store_true",
        help="sessions: every episode's first message names its client process and episode, so "
        "no two conversations are alike and none is served from the prompt cache (default: "
        "every agent sends the same conversation, as a group of samples of one task does)",
    )
    p.add_argument(
        "--fresh-database",
        action="store_true",
        help="sessions: set Steep up anew (database, key, run, agent) for every cell, so every "
        "cell starts on an empty database (default: one Steep serves all of a database's cells, "
        "each on the rows the ones before it wrote)",
    )
    p.add_argument(
        "--targets",
        help="comma list of direct, steep, litellm, sglang-router (default all; sessions: "
        "direct,steep,litellm, where direct is the client's ceiling against the stand-in)",
    )
    p.add_argument(
        "--database",
        default="sqlite,postgres",
        help="Steep's database(s): sqlite, postgres or both",
    )
    p.add_argument(
        "--steep-workers", help="uvicorn worker counts for Steep (default 1,2; sessions 1)"
    )
    p.add_argument(
        "--litellm-workers", help="LiteLLM --num_workers values (default 1,2; sessions 1)"
    )
    p.add_argument("--postgres-url", default=os.environ.get("BENCH_POSTGRES_URL", PG_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", REDIS_URL))
    p.add_argument(
        "--profile",
        action="store_true",
        help="also py-spy each Steep server under load (unmeasured; sessions: at the largest N, smallest and largest k)",
    )
    p.add_argument(
        "--json", type=Path, help="also write the results here (always written to the run folder)"
    )
    args = p.parse_args(argv)
    if args.conns is None:
        args.conns = WORKLOAD_DEFAULTS[args.workload].get("conns", "1,16,64")
    for name, value in WORKLOAD_DEFAULTS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    def ints(text):
        return [int(x) for x in text.split(",") if x.strip()]

    args.conns = ints(args.conns)
    args.agents = ints(args.agents)
    args.turns = ints(args.turns)
    args.steep_workers = ints(args.steep_workers)
    args.litellm_workers = ints(args.litellm_workers)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    args.database = [d.strip() for d in args.database.split(",") if d.strip()]
    unknown = set(args.targets) - {"direct", "steep", "litellm", "sglang-router"}
    if unknown:
        p.error(f"unknown targets: {', '.join(sorted(unknown))}")
    if args.workload == "sessions" and "sglang-router" in args.targets:
        p.error(
            "--workload sessions has no sglang-router target (it has no OpenAI chat state to compare)"
        )
    if set(args.database) - {"sqlite", "postgres"}:
        p.error("--database takes sqlite, postgres or sqlite,postgres")
    if min(args.agents + args.turns) < 1 or args.client_procs < 1:
        p.error("--agents, --turns and --client-procs take numbers of at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sessions = args.workload == "sessions"
    if args.workload == "ttft":
        return main_ttft(args, argv)
    if not sessions and shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk).", file=sys.stderr)
        return 2
    if not STEEP_PYTHON.exists():
        print(f"{STEEP_PYTHON} is missing: set up Steep's venv first.", file=sys.stderr)
        return 2
    started = time.monotonic()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = RUNS / (f"gateway-sessions-{stamp}" if sessions else f"gateway-{stamp}")
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    meta = machine()
    meta.update(
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        command="python bench/gateway.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        workload=args.workload,
        duration_s=args.duration,
        warmup_s=args.warmup,
    )
    if sessions:
        meta.update(
            agents=args.agents,
            turns=args.turns,
            client_procs=args.client_procs,
            rounds=args.rounds,
            fresh_database=args.fresh_database,
        )
    log(f"run folder {workdir.relative_to(ROOT)}; load average {meta['loadavg_before']}")

    # install peers first, so the timed part runs back to back
    if "litellm" in args.targets:
        ensure_venv("litellm", LITELLM_SPEC)
    if "sglang-router" in args.targets:
        ensure_venv("sglang-router", SGLANG_ROUTER_SPEC)

    bench = Bench(args, workdir)
    atexit.register(bench.processes.stop)
    failures = []
    try:
        bench.start_standin()
        log(f"stand-in on {bench.standin_url}")
        direct, steep, litellm = (
            (bench.direct_sessions, bench.steep_sessions, bench.litellm_sessions)
            if sessions
            else (bench.direct, bench.steep, bench.litellm)
        )
        plan = []
        if "direct" in args.targets:
            plan.append(("direct", direct, ()))
        if "steep" in args.targets:
            for database in args.database:
                for w in args.steep_workers:
                    plan.append((f"steep {database} w{w}", steep, (database, w)))
        if "litellm" in args.targets:
            for w in args.litellm_workers:
                plan.append((f"litellm w{w}", litellm, (w,)))
        if "sglang-router" in args.targets:
            plan.append(("sglang-router", bench.sglang_router, ()))
        for label, fn, fargs in plan:
            log(f"{label} (load average {os.getloadavg()[0]:.2f})")
            try:
                fn(*fargs)
            except Exception as exc:  # one target failing must not lose the others
                failures.append(f"{label}: {exc}")
                log(f"  FAILED: {exc}")
    finally:
        bench.processes.stop()

    meta["wall_s"] = round(time.monotonic() - started)
    meta["loadavg_after"] = os.getloadavg()
    if sessions:
        text = sessions_load.report(
            bench.sessions,
            verdict_agents=200 if 200 in args.agents else max(args.agents),
            verdict_turns=3 if 3 in args.turns else max(args.turns),
        )
        client = f"aiohttp client in {args.client_procs} processes"
        if args.distinct_conversations:
            client += ", every conversation distinct"
        if args.fresh_database:
            client += ", every Steep cell on a fresh database"
    else:
        text = report(bench.results, args.conns, meta)
        client = meta["wrk"]
    header = (
        f"Machine: {meta['cpus']} CPUs ({meta['cpu']}), Python {meta['python']}, {client}; "
        f"{meta['date']}; {args.duration:g} s per cell after {args.warmup:g} s warm-up; "
        f"wall time {meta['wall_s']} s; load average before {meta['loadavg_before'][0]:.2f}, after {meta['loadavg_after'][0]:.2f}."
    )
    print(header + "\n\n" + text)
    if failures:
        print("Failed targets:\n" + "\n".join(f"- {f}" for f in failures))
    results = (
        [c.as_json() for c in bench.sessions] if sessions else [asdict(r) for r in bench.results]
    )
    payload = {"meta": meta, "results": results, "failures": failures}
    (workdir / "results.json").write_text(json.dumps(payload, indent=2))
    (workdir / "report.md").write_text(header + "\n\n" + text + "\n")
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2))
    log(f"results in {workdir.relative_to(ROOT)}/results.json")
    return 1 if failures else 0


def main_ttft(args, argv) -> int:
    """``--workload ttft``: Steep (SQLite, one worker) and the streaming stand-in; see bench/ttft.py."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = RUNS / f"gateway-ttft-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    meta = machine()
    meta.update(
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        command="python bench/gateway.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        tokens=args.tokens,
        token_delay_ms=args.token_delay_ms,
    )
    bench = Bench(args, workdir)
    atexit.register(bench.processes.stop)
    try:
        bench.start_standin()
        with bench.steep_server("sqlite", 1) as server:
            cells = ttft.measure(
                standin_url=bench.standin_url,
                chat_url=f"{server.base}/chat/completions",
                key=server.key,
                conns=args.conns,
                duration=args.duration,
                warmup=args.warmup,
                tokens=args.tokens,
                log=log,
                pids={"gateway": server.proc.pid, "standin": bench.standin_pid},
            )
            if args.profile:  # the streamed cell at the most clients again, under py-spy
                bench.spy(
                    server.proc,
                    "steep-ttft-stream",
                    lambda seconds: ttft.measure(
                        standin_url=bench.standin_url,
                        chat_url=f"{server.base}/chat/completions",
                        key=server.key,
                        conns=[max(args.conns)],
                        duration=seconds,
                        warmup=0,
                        tokens=args.tokens,
                        log=log,
                        targets=("Steep, stream",),
                    ),
                )
    finally:
        bench.processes.stop()
    meta["loadavg_after"] = os.getloadavg()
    header = (
        f"Machine: {meta['cpus']} CPUs ({meta['cpu']}), Python {meta['python']}; {meta['date']}; "
        f"stand-in {args.tokens} tokens at {args.token_delay_ms:g} ms each; {args.duration:g} s per "
        f"cell after {args.warmup:g} s warm-up; load average before {meta['loadavg_before'][0]:.2f}, "
        f"after {meta['loadavg_after'][0]:.2f}."
    )
    text = ttft.report(cells)
    print(header + "\n\n" + text)
    payload = {"meta": meta, "results": [c.as_json() for c in cells]}
    (workdir / "results.json").write_text(json.dumps(payload, indent=2))
    (workdir / "report.md").write_text(header + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
