"""Gateway benchmark (issue #4): Steep's gateway against LiteLLM's proxy and SGLang's router.

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

    .venv/bin/python bench/gateway.py                     # everything, ~7 minutes
    .venv/bin/python bench/gateway.py --targets direct,steep --database sqlite --duration 5

The peers' venvs are created under ``.steep/bench-venvs/`` on first use (idempotent);
each run's files (databases, logs, wrk scripts, results.json) go to
``.steep/bench/gateway-<time>/``. Everything started is stopped at the end.
See docs/benchmarks.md ("Gateway") for the results and how to read them.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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


# --- processes -------------------------------------------------------------------------------

_STARTED: list[subprocess.Popen] = []


def start(cmd: list[str], *, name: str, logdir: Path, env: dict | None = None, cwd=None):
    out = open(logdir / f"{name}.log", "ab")
    proc = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd or ROOT,
        start_new_session=True,  # its own process group: workers and children stop with it
    )
    proc.bench_name = name  # type: ignore[attr-defined]
    _STARTED.append(proc)
    return proc


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(5)
    else:
        # the leader is gone; make sure nothing it started lingers in its group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc in _STARTED:
        _STARTED.remove(proc)


def stop_all() -> None:
    for proc in list(reversed(_STARTED)):
        stop(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None, timeout=5.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, resp.read()


def wait_ready(
    proc, url: str, *, body=None, headers=None, timeout: float = 120.0, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what or url} exited with {proc.returncode}; see its log")
        try:
            status, _ = http("POST" if body is not None else "GET", url, body, headers, timeout=5)
            if status == 200:
                return
            last = f"HTTP {status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
        except (OSError, urllib.error.URLError) as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise RuntimeError(f"{what or url} not ready after {timeout:.0f}s ({last})")


def run_checked(cmd: list[str], *, env=None, what: str) -> str:
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


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


class Bench:
    def __init__(self, args, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.standin_port = 0
        self.results: list[Result] = []

    # stand-in
    def start_standin(self) -> None:
        self.standin_port = free_port()
        proc = start(
            [str(STEEP_PYTHON), "bench/standin.py", "--port", str(self.standin_port)],
            name="standin",
            logdir=self.logs,
        )
        wait_ready(proc, f"{self.standin_url}/health", what="stand-in", timeout=30)

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
    def steep_env(self, database: str, data_dir: Path, port: int) -> dict:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "REDIS_URL", "DATABASE_URL_FILE", "REDIS_URL_FILE")
        }
        env.update(
            DJANGO_SETTINGS_MODULE="webapp.settings",
            DATA_DIR=str(data_dir),
            DEBUG="false",
            SECRET_KEY="bench-gateway-not-a-secret-" + "x" * 32,
            ALLOWED_HOSTS="127.0.0.1,localhost",
            SITE_URL=f"http://127.0.0.1:{port}",
            LOG_LEVEL="WARNING",
            PYTHONUNBUFFERED="1",
        )
        if database == "postgres":
            env["DATABASE_URL"] = self.args.postgres_url
            env["REDIS_URL"] = self.args.redis_url
        return env

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
        env = self.steep_env(database, data_dir, port)
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
        code = (
            "import json; from webapp.gateway.models import Interaction, Session; "
            "print('COUNTS', json.dumps({'sessions': Session.objects.count(), "
            "'interactions': Interaction.objects.count()}))"
        )
        out = run_checked(
            [str(STEEP_PYTHON), "manage.py", "shell", "-c", code], env=env, what="count rows"
        )
        line = [x for x in out.splitlines() if x.startswith("COUNTS ")][-1]
        return json.loads(line[len("COUNTS ") :])

    def steep(self, database: str, workers: int) -> None:
        port = free_port()
        env, key, agent_id, data_dir = self.steep_setup(database, workers, port)
        cmd = [
            str(STEEP_PYTHON), "-m", "uvicorn", "webapp.asgi:application",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
            "--log-level", "warning", "--no-access-log", "--lifespan", "off",
        ]  # fmt: skip
        name = f"steep-{database}-w{workers}"
        proc = start(cmd, name=name, logdir=self.logs, env=env)
        url = f"http://127.0.0.1:{port}/agents/{agent_id}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {key}"}
        try:
            wait_ready(proc, url, body=CHAT_BODY, headers=headers, what=name, timeout=60)
            if workers > 1:  # every worker loads its tokenizer on its first request
                for _ in range(4 * workers):
                    http("POST", url, CHAT_BODY, headers)
            lua = write_lua(self.workdir / f"{name}.lua", headers)
            label = f"Steep, {'SQLite' if database == 'sqlite' else 'Postgres+Redis'}, {workers} worker{'s' if workers > 1 else ''}"
            result = self.sweep(label, "steep", url, lua, workers=workers, database=database)
            if self.args.profile:
                self.profile(proc, url, lua, name)
        finally:
            stop(proc)
        counts = self.steep_counts(env)
        ok = sum(c.requests - c.detail["err_status"] for c in result.cells)
        result.notes.append(
            f"{counts['interactions']} interactions / {counts['sessions']} sessions recorded "
            f"(measured cells: {ok} successful responses; the rest are warm-up)"
        )
        if database == "sqlite":
            size = sum(p.stat().st_size for p in data_dir.glob("steep.sqlite3*"))
            result.notes.append(f"database {size / 1e6:.0f} MB")
        log(f"  {result.notes[-1] if database == 'postgres' else '; '.join(result.notes)}")

    def profile(self, proc, url: str, lua: Path, name: str) -> None:
        """py-spy the server (all workers) under load at the largest connection count; not measured."""
        pyspy = ROOT / ".venv" / "bin" / "py-spy"
        if not pyspy.exists():
            log("  (no .venv/bin/py-spy; skipping the profile)")
            return
        seconds = max(5, round(self.args.duration))
        out = self.workdir / f"profile-{name}.txt"
        spy = subprocess.Popen(
            [str(pyspy), "record", "--pid", str(proc.pid), "--subprocesses", "--duration",
             str(seconds), "--rate", "250", "--format", "raw", "--output", str(out), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1)
        wrk(url, lua, max(self.args.conns), seconds)
        spy.wait(60)
        log(f"  profile (collapsed stacks) -> {out.relative_to(ROOT)}")

    # --- LiteLLM
    def litellm(self, workers: int) -> None:
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
        proc = start(cmd, name=name, logdir=self.logs, env=env, cwd=home)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
        try:
            wait_ready(proc, url, body=CHAT_BODY, headers=headers, what=name, timeout=180)
            for _ in range(4 * workers):
                http("POST", url, CHAT_BODY, headers, timeout=30)
            lua = write_lua(self.workdir / f"{name}.lua", headers)
            label = f"LiteLLM proxy, {workers} worker{'s' if workers > 1 else ''}"
            self.sweep(
                label, "litellm", url, lua, workers=workers, version=pip_version(venv, "litellm")
            )
        finally:
            stop(proc)

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
        proc = start(cmd, name="sglang-router", logdir=self.logs, env=env)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            wait_ready(proc, url, body=CHAT_BODY, what="sglang-router", timeout=60)
            lua = write_lua(self.workdir / "sglang-router.lua", {})
            self.sweep(
                "sglang-router, round_robin",
                "sglang-router",
                url,
                lua,
                version=pip_version(venv, "sglang-router"),
            )
        finally:
            stop(proc)


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Steep gateway benchmark (issue #4).")
    p.add_argument(
        "--duration", type=float, default=10, help="seconds measured per cell (default 10)"
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=3,
        help="seconds of unmeasured load before each cell (default 3)",
    )
    p.add_argument("--conns", default="1,16,64", help="connection counts (default 1,16,64)")
    p.add_argument(
        "--targets",
        default="direct,steep,litellm,sglang-router",
        help="comma list of direct, steep, litellm, sglang-router",
    )
    p.add_argument(
        "--database",
        default="sqlite,postgres",
        help="Steep's database(s): sqlite, postgres or both",
    )
    p.add_argument(
        "--steep-workers", default="1,2", help="uvicorn worker counts for Steep (default 1,2)"
    )
    p.add_argument(
        "--litellm-workers", default="1,2", help="LiteLLM --num_workers values (default 1,2)"
    )
    p.add_argument("--postgres-url", default=os.environ.get("BENCH_POSTGRES_URL", PG_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", REDIS_URL))
    p.add_argument(
        "--profile",
        action="store_true",
        help="also py-spy each Steep server under load (unmeasured)",
    )
    p.add_argument(
        "--json", type=Path, help="also write the results here (always written to the run folder)"
    )
    args = p.parse_args(argv)

    def ints(text):
        return [int(x) for x in text.split(",") if x.strip()]

    args.conns = ints(args.conns)
    args.steep_workers = ints(args.steep_workers)
    args.litellm_workers = ints(args.litellm_workers)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    args.database = [d.strip() for d in args.database.split(",") if d.strip()]
    unknown = set(args.targets) - {"direct", "steep", "litellm", "sglang-router"}
    if unknown:
        p.error(f"unknown targets: {', '.join(sorted(unknown))}")
    if set(args.database) - {"sqlite", "postgres"}:
        p.error("--database takes sqlite, postgres or sqlite,postgres")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk).", file=sys.stderr)
        return 2
    if not STEEP_PYTHON.exists():
        print(f"{STEEP_PYTHON} is missing: set up Steep's venv first.", file=sys.stderr)
        return 2
    started = time.monotonic()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = RUNS / f"gateway-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    meta = machine()
    meta.update(
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        command="python bench/gateway.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        duration_s=args.duration,
        warmup_s=args.warmup,
    )
    log(f"run folder {workdir.relative_to(ROOT)}; load average {meta['loadavg_before']}")

    # install peers first, so the timed part runs back to back
    if "litellm" in args.targets:
        ensure_venv("litellm", LITELLM_SPEC)
    if "sglang-router" in args.targets:
        ensure_venv("sglang-router", SGLANG_ROUTER_SPEC)

    bench = Bench(args, workdir)
    failures = []
    try:
        bench.start_standin()
        log(f"stand-in on {bench.standin_url}")
        plan = []
        if "direct" in args.targets:
            plan.append(("direct", bench.direct, ()))
        if "steep" in args.targets:
            for database in args.database:
                for w in args.steep_workers:
                    plan.append((f"steep {database} w{w}", bench.steep, (database, w)))
        if "litellm" in args.targets:
            for w in args.litellm_workers:
                plan.append((f"litellm w{w}", bench.litellm, (w,)))
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
        stop_all()

    meta["wall_s"] = round(time.monotonic() - started)
    meta["loadavg_after"] = os.getloadavg()
    text = report(bench.results, args.conns, meta)
    header = (
        f"Machine: {meta['cpus']} CPUs ({meta['cpu']}), Python {meta['python']}, {meta['wrk']}; "
        f"{meta['date']}; {args.duration:g} s per cell after {args.warmup:g} s warm-up; "
        f"wall time {meta['wall_s']} s; load average before {meta['loadavg_before'][0]:.2f}, after {meta['loadavg_after'][0]:.2f}."
    )
    print(header + "\n\n" + text)
    if failures:
        print("Failed targets:\n" + "\n".join(f"- {f}" for f in failures))
    payload = {"meta": meta, "results": [asdict(r) for r in bench.results], "failures": failures}
    (workdir / "results.json").write_text(json.dumps(payload, indent=2))
    (workdir / "report.md").write_text(header + "\n\n" + text + "\n")
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2))
    log(f"results in {workdir.relative_to(ROOT)}/results.json")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
