"""The fault tests' harness: a live Steep whose processes a test kills and restarts, agents that
keep playing through the faults, and the checks every fault test ends with.

- ``Chaos``: a live stack (uvicorn, a Celery worker with beat and the local Ray head it
  starts, the runs' jobs) that a test kills and restarts: ``restart_web()``,
  ``kill_worker()`` / ``start_worker()``, ``inference_servers()``, and ``arm()`` for the
  trainer's failpoints (``rl_core.failpoints``). Short reconcile and long-poll settings
  (``CHAOS_ENV``) so that a fault is noticed in seconds. The ``chaos`` fixture
  (``conftest.py``) is one such stack on the pytest-django test database, shared by the
  folder's tests.
- ``Agents``: agent threads playing two-turn, rewarded sessions with the official ``openai``
  SDK (its own retries on connection errors, 429 and 5xx, honouring ``Retry-After``) and
  httpx for ``/rl/*`` (retried the same way), recording what was acknowledged.
- ``assert_ledger_exact(rest, run_id)``: the run's ledger (``GET /api/v1/runs/<id>/ledger/``)
  balances and no trajectory was trained twice; ``assert_ledger_in_database(...)``: the test
  database says the same; ``assert_acknowledged_kept(...)``: every acknowledged completion is
  a row, every acknowledged end a session ended once.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rl_core.failpoints import arm
from rl_core.toy import TOY_SETTINGS, toy_rows
from tests.conftest import test_database_url
from tests.livestack import LiveStack, answers, free_port, steep_env, wait_for

# A fault must be seen in seconds, not in the production defaults' minutes.
CHAOS_ENV = {
    "INTERNAL_API_LONG_POLL_S": "5",
    "RUN_RECONCILE_INTERVAL_S": "2",
    "STEEP_DEMO_AGENT": "false",
    "GATEWAY_RETRY_AFTER_S": "1",
}
RETRYABLE = {408, 409, 429, 500, 502, 503, 504}  # what an agent's SDK retries (409 aside)


@dataclass
class Chaos:
    url: str
    port: int
    model_dir: Path
    processes: LiveStack
    env: dict[str, str]
    data_dir: Path
    failpoints: Path | None = None
    web: Any = None
    worker: Any = None

    def arm(self, entries: list[dict]) -> None:
        """Where the next runs' trainers kill themselves (each entry once)."""
        assert self.failpoints is not None, "a stack started without STEEP_FAILPOINTS"
        arm(self.failpoints, entries)

    def armed(self) -> list[dict]:
        """The entries not met yet."""
        assert self.failpoints is not None, "a stack started without STEEP_FAILPOINTS"
        return json.loads(self.failpoints.read_text())

    def log_tail(self, lines: int = 60) -> str:
        return self.processes.log_tail(lines)

    def start_web(self) -> None:
        self.web = self.processes.start_web(self.port)
        self.processes.wait_ready(
            self.web, lambda: answers(f"{self.url}/login/"), what="the web server"
        )

    def restart_web(self, sig: signal.Signals = signal.SIGKILL) -> float:
        """Kill the web process (its whole group) and start it again; seconds it was down."""
        down = time.monotonic()
        os.killpg(self.web.pid, sig)
        self.web.wait(20)
        self.processes.stop(self.web)
        self.start_web()
        return time.monotonic() - down

    def start_worker(self) -> None:
        self.worker = self.processes.start_worker()

    def kill_worker(self) -> None:
        """SIGKILL the Celery worker's process group (the worker, beat, its pool)."""
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(20)
        self.processes.stop(self.worker)

    def inference_servers(self) -> list[dict]:
        """The runs' torch engines running now (their records under DATA_DIR/pids/inference)."""
        records = []
        for path in sorted((self.data_dir / "pids" / "inference").glob("*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if Path(f"/proc/{record['pid']}").exists():
                records.append(record)
        return records


def chaos_env(data_dir: Path, url: str, **extra: str) -> dict[str, str]:
    from django.conf import settings

    return steep_env(
        data_dir=data_dir,
        database_url=test_database_url(),
        redis_url=settings.REDIS_URL,
        site_url=url,
        local_ray=True,
        **{**CHAOS_ENV, **extra},
    )


# --------------------------------------------------------------------------- runs


def run_state(rest: httpx.Client, run_id: str) -> dict:
    return call(rest, "GET", f"/runs/{run_id}/").json()


def call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """A REST call retried while the web app is down or restarting (refused, 5xx)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            response = client.request(method, path, **kwargs)
            if response.status_code < 500 or time.monotonic() > deadline:
                return response
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def create_dataset_run(
    rest: httpx.Client, model_dir: Path, *, rows: int = 64, **overrides: Any
) -> dict:
    """A dataset run on the toy task's first ``rows`` rows (batches of 16, 6 steps,
    checkpoints every 2 unless overridden)."""
    body = "".join(json.dumps(row) + "\n" for row in toy_rows(rows)).encode()
    dataset = rest.post(
        "/datasets/", data={"name": f"letters-{time.time_ns()}"}, files={"file": ("l.jsonl", body)}
    ).json()
    settings = {**TOY_SETTINGS, "batch_size": 16, "max_steps": 6, "save_every": 2, **overrides}
    created = rest.post(
        "/runs/",
        json={
            "name": "chaos",
            "mode": "dataset",
            "base_model": str(model_dir),
            "dataset": dataset["id"],
            **settings,
        },
    )
    assert created.status_code == 201, created.text
    return created.json()


def create_online_run(rest: httpx.Client, model_dir: Path, **overrides: Any) -> tuple[dict, dict]:
    """An online run (batches of 4, checkpoints every 2 steps) and an agent on it."""
    settings = {
        "batch_size": 4,
        "max_staleness": 1,
        "max_steps": 6,
        "save_every": 2,
        "learning_rate": 1e-3,
        **overrides,
    }
    created = rest.post(
        "/runs/",
        json={"name": "chaos online", "mode": "online", "base_model": str(model_dir), **settings},
    )
    assert created.status_code == 201, created.text
    run = created.json()
    agent = rest.post("/agents/", json={"name": "chaos agent", "run": run["id"]}).json()
    return run, agent


def start_and_wait_running(rest: httpx.Client, chaos: Chaos, run_id: str) -> None:
    assert rest.post(f"/runs/{run_id}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, run_id)["status"] == "running",
        240,
        f"the run to be running\n{chaos.log_tail()}",
    )


def wait_step(rest: httpx.Client, chaos: Chaos, run_id: str, step: int, timeout=300) -> None:
    def reached() -> bool:
        state = run_state(rest, run_id)
        assert state["status"] not in ("failed", "stopped"), (state, chaos.log_tail())
        return state["step"] >= step

    wait_for(reached, timeout, f"step {step}\n{chaos.log_tail()}")


def wait_finished(rest: httpx.Client, chaos: Chaos, run_id: str, timeout=480) -> dict:
    """The run's state once it completed (or failed for good, which fails the test)."""

    def done() -> dict | None:
        state = run_state(rest, run_id)
        return state if state["status"] == "completed" else None

    try:
        return wait_for(done, timeout, "the run to complete")
    except TimeoutError:
        state = run_state(rest, run_id)
        raise AssertionError(
            f"run did not complete: {state}\n{_run_story(run_id)}\n{chaos.log_tail()}"
        ) from None


def _run_story(run_id: str) -> str:
    """The run's events and its Ray job's last log lines, as the database holds them: what a
    timed-out chaos test needs to tell a hang from a slow machine."""
    from webapp.runs.models import Run, RunEvent

    events = RunEvent.objects.filter(run_id=run_id).order_by("created_at", "id")
    lines = [f"{e.created_at:%H:%M:%S} {e.kind}: {e.message[:300]}" for e in events]
    run = Run.objects.filter(pk=run_id).first()
    tail = getattr(run, "job_log_tail", "") or ""
    return "--- run events\n" + "\n".join(lines) + "\n--- job log tail\n" + tail[-6000:]


# --------------------------------------------------------------------------- the ledger


def assert_ledger_exact(
    rest: httpx.Client, run_id: str, *, steps: int, batch_size: int | None = None
) -> dict:
    """accepted = trained once + dropped (each with a reason) + pending, no trajectory id
    trained twice in the surviving lineage, and steps 1..``steps`` each trained something
    (with ``batch_size``: exactly one batch, which holds when a session is one trajectory, as
    a dataset run's are); returns the ledger."""
    response = call(rest, "GET", f"/runs/{run_id}/ledger/")
    assert response.status_code == 200, response.text
    ledger = response.json()
    by_step = ledger["trained_by_step"]
    assert [item["step"] for item in by_step] == list(range(1, steps + 1)), ledger
    if batch_size is not None:
        assert all(item["count"] == batch_size for item in by_step), ledger
    assert ledger["trained_twice"] == [], ledger
    assert sum(ledger["dropped_by_reason"].values()) == ledger["dropped"], ledger
    assert sum(item["count"] for item in ledger["trained_by_step"]) == ledger["trained"], ledger
    assert ledger["accepted"] == ledger["trained"] + ledger["dropped"] + ledger["pending"], ledger
    assert ledger["balanced"] is True, ledger
    return ledger


def assert_ledger_in_database(run_id: str, ledger: dict, *, steps: int) -> None:
    """The test database agrees with ``ledger``: one training record per trained session,
    nothing left claimed once the run ended, every session that went to training counted as
    accepted, every trained version within 1..``steps``."""
    from webapp.gateway.models import Session, TrainingRecord

    sessions = Session.objects.filter(run_id=run_id)
    records = TrainingRecord.objects.filter(run_id=run_id)
    trained = set(sessions.filter(trajectory="trained").values_list("id", flat=True))
    assert set(records.values_list("session_id", flat=True)) == trained
    assert records.count() == len(trained) == ledger["trained"]
    assert not sessions.filter(trajectory="claimed").exists(), "the run ended: nothing claimed"
    went_to_training = sessions.exclude(trajectory__in=["pending", "unrewarded"]).count()
    assert went_to_training == ledger["accepted"]
    for session in sessions.filter(trajectory="trained"):
        assert 1 <= session.trained_version <= steps, session.trained_version


# --------------------------------------------------------------------------- agents


@dataclass
class Agents:
    """``count`` agent threads playing two-turn rewarded sessions on ``base_url`` until
    ``stop()``; what each call answered is recorded.

    ``acknowledged``: completion ids the agents got back; ``ended``: sessions whose
    ``end_session`` was acknowledged (a retried end answered 409 ``session_ended`` counts: the
    first attempt ended it); ``retryable``: the retryable answers seen (status or exception
    name); ``failures``: anything else (must stay empty).
    """

    base_url: str
    project_key: str
    count: int = 3
    acknowledged: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    retryable: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Agents:
        for n in range(self.count):
            thread = threading.Thread(target=self._play, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in self._threads), "an agent hung"

    def wait_sessions(self, n: int, timeout: float = 240) -> None:
        wait_for(lambda: len(self.ended) >= n or self.failures, timeout, f"{n} ended sessions")
        assert not self.failures, self.failures

    # --- one agent

    def _rl(self, http: httpx.Client, path: str, key: str, body: dict) -> httpx.Response | None:
        """A ``/rl/*`` call retried like the SDK retries (connection errors, 429, 5xx with
        their Retry-After); None when the agents are stopping."""
        attempt = 0
        while not self._stop.is_set():
            attempt += 1
            try:
                response = http.post(
                    f"{self.base_url}/rl/{path}",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                )
            except httpx.TransportError as exc:
                self._note_retry(type(exc).__name__)
                time.sleep(min(0.25 * attempt, 2))
                continue
            if response.status_code in (429, 503) or response.status_code >= 500:
                self._check_retryable(response)
                time.sleep(min(float(response.headers.get("Retry-After", "1")), 2))
                continue
            return response
        return None

    def _check_retryable(self, response: httpx.Response) -> None:
        if response.status_code == 503 and _error_code(response) == "run_not_running":
            raise _RunOver  # the run completed: nothing to retry, the agent is done
        self._note_retry(str(response.status_code))
        if response.status_code in (429, 503) and "Retry-After" not in response.headers:
            self._fail(f"{response.status_code} without Retry-After: {response.text[:300]}")
        if response.status_code >= 500 and response.status_code != 503:
            self._fail(f"{response.status_code}: {response.text[:300]}")

    def _note_retry(self, what: str) -> None:
        with self._lock:
            self.retryable[what] += 1

    def _fail(self, message: str) -> None:
        with self._lock:
            self.failures.append(message)

    def _play(self, n: int) -> None:
        from openai import APIConnectionError, APIStatusError, OpenAI

        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                try:
                    self._episode(http, n, OpenAI, APIStatusError, APIConnectionError)
                except _RunOver:
                    return
                except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                    self._fail(f"agent {n}: {type(exc).__name__}: {exc}")
                    return

    def _episode(self, http, n: int, OpenAI, APIStatusError, APIConnectionError) -> None:
        started = self._rl(http, "start_session", self.project_key, {"task_id": f"chaos-{n}"})
        if started is None:
            return
        if started.status_code != 201:
            raise AssertionError(f"start_session {started.status_code}: {started.text[:300]}")
        session = started.json()
        client = OpenAI(
            base_url=self.base_url, api_key=session["api_key"], max_retries=2, timeout=60
        )
        messages = [{"role": "user", "content": "Say a."}]
        for _ in range(2):
            # One key per turn, kept across our own re-sends too: a turn recorded whose answer
            # was lost (the web process died) is answered from the database, never sampled twice.
            idempotency = {"Idempotency-Key": uuid.uuid4().hex}
            while True:
                try:
                    reply = client.chat.completions.create(
                        model="policy",
                        messages=messages,
                        max_tokens=4,
                        temperature=1.0,
                        extra_headers=idempotency,
                    )
                    break
                except APIConnectionError as exc:  # the SDK's own retries ran out
                    self._note_retry(type(exc).__name__)
                except APIStatusError as exc:
                    if exc.status_code not in RETRYABLE or exc.status_code == 409:
                        raise
                    self._check_retryable(exc.response)
                if self._stop.is_set():
                    return
            with self._lock:
                self.acknowledged.append(reply.id)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "Again."},
            ]
        reward = float("a" in (reply.choices[0].message.content or ""))
        rewarded = self._rl(http, "set_reward", session["api_key"], {"reward": reward})
        if rewarded is None:
            return
        if rewarded.status_code != 200:
            raise AssertionError(f"set_reward {rewarded.status_code}: {rewarded.text[:300]}")
        ended = self._rl(http, "end_session", session["api_key"], {})
        if ended is None:
            return
        replayed = ended.status_code == 409 and ended.json()["error"]["code"] == "session_ended"
        if ended.status_code != 200 and not replayed:
            raise AssertionError(f"end_session {ended.status_code}: {ended.text[:300]}")
        with self._lock:
            self.ended.append(session["session_id"])


class _RunOver(Exception):
    """The gateway said the run is no longer running."""


def _error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def assert_acknowledged_kept(agents: Agents, run_id: str, database_url: str = "") -> None:
    """Every completion an agent was answered is one recorded turn; every session whose end
    was acknowledged is ended (its trajectory went on to training). ``database_url``: read
    there, not in the test's own database."""
    assert not agents.failures, agents.failures
    assert len(set(agents.acknowledged)) == len(agents.acknowledged), "an id answered twice"
    if database_url:
        turns, statuses = recorded_in(database_url, run_id)
    else:
        from webapp.gateway.models import Interaction, Session

        turns = set(Interaction.objects.filter(session__run_id=run_id).values_list("id", flat=True))
        statuses = {
            str(pk): status
            for pk, status in Session.objects.filter(run_id=run_id).values_list("pk", "status")
        }
    missing = set(agents.acknowledged) - turns
    assert not missing, f"{len(missing)} acknowledged turns lost: {sorted(missing)[:5]}"
    not_ended = {sid: statuses.get(sid) for sid in agents.ended if statuses.get(sid) != "ended"}
    assert not not_ended, f"acknowledged ends lost: {not_ended}"


# --------------------------------------------------------------------------- a private PostgreSQL


def _pg_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(candidates[-1]) if candidates else None


@dataclass
class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (never the machine's shared one), on a free port,
    run as the ``postgres`` OS user when the test runs as root (initdb refuses root)."""

    root: Path
    port: int
    pg_ctl: str
    as_user: list[str]

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/steep"

    def ctl(self, *args: str) -> None:
        command = [*self.as_user, self.pg_ctl, "-D", str(self.root / "data"), *args]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        self.ctl("-o", options, "-l", str(self.root / "postgres.log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self.ctl("-m", mode, "-w", "stop")

    def log_tail(self, lines: int = 30) -> str:
        text = (self.root / "postgres.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@pytest.fixture(scope="module")
def private_postgres():
    """A fresh cluster with an empty database ``steep``; skipped (saying why) when this machine
    has no PostgreSQL server binaries, or runs as root without a ``postgres`` user."""
    initdb, pg_ctl = _pg_binary("initdb"), _pg_binary("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (apt-get install postgresql)")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="steep-chaos-pg-"))
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root)
            pytest.skip("running as root and there is no 'postgres' user to run initdb as")
        if not shutil.which("runuser"):
            shutil.rmtree(root)
            pytest.skip("running as root without runuser to run initdb as 'postgres'")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    server = PrivatePostgres(root, free_port(), pg_ctl, as_user)
    try:
        subprocess.run(
            [
                *as_user,
                initdb,
                "-D",
                str(root / "data"),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        server.start()
        import psycopg

        with psycopg.connect(server.url.replace("/steep", "/postgres"), autocommit=True) as c:
            c.execute("CREATE DATABASE steep")
        yield server
    finally:
        try:
            server.stop("immediate")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(root, ignore_errors=True)


def recorded_in(database_url: str, run_id: str) -> tuple[set[str], dict[str, str]]:
    """What a database outside the test's own holds for a run: its turns' ids, and its
    sessions' statuses by id."""
    import psycopg

    with psycopg.connect(database_url) as db:
        turns = db.execute(
            "SELECT i.id FROM gateway_interaction i JOIN gateway_session s ON s.id = i.session_id"
            " WHERE s.run_id = %s",
            [run_id],
        ).fetchall()
        sessions = db.execute(
            "SELECT id::text, status FROM gateway_session WHERE run_id = %s", [run_id]
        ).fetchall()
    return {row[0] for row in turns}, dict(sessions)
