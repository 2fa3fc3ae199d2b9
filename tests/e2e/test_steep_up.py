"""``./steep up`` stops cleanly and starts again where it left off (issue 12).

Five times: start ``./steep up`` (embedded defaults, its own DATA_DIR and ports), wait until
a run trains, press Ctrl-C (SIGINT to its process group, as a terminal does). Each time it
must be gone within 10 s, print no traceback and leave no process behind (neither one it
started nor a run's inference server, which runs in a session of its own); no run may fail,
and the run resumes from its last checkpoint at the next start instead of from step 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import time
import urllib.request
from functools import partial
from pathlib import Path

import pytest

from rl_core.toy import TOY_SETTINGS
from tests.livestack import free_port, steep_env, wait_for
from workers.ray_cluster import _ray_temp_dir, inference_pid_dir, stop_local_cluster

ROOT = Path(__file__).resolve().parents[2]
CYCLES = 5
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def installed() -> bool:
    """``./steep up`` would not install anything first (as ``./steep test`` leaves .venv)."""
    stamp = ROOT / ".venv" / ".steep-installed"
    if not (ROOT / ".venv" / "bin" / "python").exists() or not stamp.exists():
        return False
    # What ./steep's install() hashes: pyproject.toml, then the SGLang contract pins.
    files = (ROOT / "pyproject.toml", ROOT / "deploy" / "sglang-check.txt")
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    return stamp.read_text().startswith(digest)


pytestmark = [
    pytest.mark.slow,
    # Never skipped in CI (CI=true), where .ci/run has installed: a stale stamp there fails.
    pytest.mark.skipif(
        not installed() and not os.environ.get("CI"), reason="needs ./steep install"
    ),
    # Five full starts: ~270 s on a quiet 2-core machine, twice that beside CI's other lanes.
    pytest.mark.timeout(900),
]


class Steep:
    """``./steep up`` on ``data_dir`` and ``port``; its output in ``log_dir/up-N.log``."""

    def __init__(self, data_dir: Path, port: int, log_dir: Path):
        self.data_dir, self.port, self.log_dir = data_dir, port, log_dir
        self.url = f"http://127.0.0.1:{port}"
        # The demo is made but not started, and its agent stays off: what they add (its pool
        # and two runs resuming at every start, one training all the time) is not what this
        # test is about, and beside CI's other lanes on two cores it took five cycles past
        # the 600 s timeout. The run this test starts is the one that must stop and resume.
        self.env = steep_env(
            data_dir=data_dir,
            local_ray=True,
            STEEP_PORT=str(port),
            STEEP_DEMO_AGENT="false",
            STEEP_DEMO_START="false",
        )
        for name in ("SITE_URL", "INTERNAL_API_URL", "STEEP_HOST", "LOG_FORMAT"):
            self.env.pop(name, None)
        self.process: subprocess.Popen | None = None
        self.log: Path | None = None

    def start(self, cycle: int) -> None:
        self.log = self.log_dir / f"up-{cycle}.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                ["./steep", "up"],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group, as a shell's foreground job
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log else ""

    def check_up(self) -> None:
        if self.process.poll() is not None:
            if (
                "already in use" in self.output()
                or "error while attempting to bind" in self.output()
            ):
                pytest.skip(f"a port Steep needs was taken meanwhile:\n{self.output()[-2000:]}")
            raise AssertionError(f"./steep up exited ({self.process.returncode}):\n{self.output()}")

    def api_key(self) -> str:
        return [line.split()[2] for line in self.output().splitlines() if "API key" in line][-1]

    def rest(self, method: str, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(
            f"{self.url}/api/v1{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={
                "Authorization": f"Bearer {self.api_key()}",
                "Content-Type": "application/json",
            },
        )
        with DIRECT.open(request, timeout=30) as response:
            return json.loads(response.read())

    def db(self, query: str, *args) -> list[tuple]:
        with sqlite3.connect(f"file:{self.data_dir / 'steep.sqlite3'}?mode=ro", uri=True) as db:
            return db.execute(query, args).fetchall()


def started(pid: int) -> int | None:
    """When ``pid`` started, if it runs (a zombie has exited: its parent has yet to reap it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def processes() -> dict[int, tuple[int | None, int, str]]:
    """Every process of this user: PID → (start time, session id, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[19]), int(fields[3]), command)
    return found


def steeps_processes(steep: Steep) -> dict[int, int | None]:
    """What this ``./steep up`` runs now (PID → start time): its session (web, worker, the
    Ray head), the runs' jobs (sessions of their own) and the recorded inference servers."""
    markers = (str(_ray_temp_dir(steep.data_dir)), f"--web-url {steep.url}", str(steep.data_dir))
    ours = {
        pid: start
        for pid, (start, session, command) in processes().items()
        if session == steep.process.pid or any(marker in command for marker in markers)
    }
    for record in inference_pid_dir(steep.data_dir).glob("*.json"):
        pid = json.loads(record.read_text())["pid"]
        ours[pid] = started(pid)
    return ours


def _still_running(pids: dict[int, int | None], grace_s: float = 5.0) -> set[int]:
    """Which of ``pids`` (PID → start time) still run after ``grace_s``: a process SIGKILLed
    by the stop is gone at once on a quiet machine, but under load its exit (and its
    reaping) can trail ``./steep up``'s own exit by a moment."""
    deadline = time.monotonic() + grace_s
    while True:
        left = {pid for pid, start in pids.items() if start is not None and started(pid) == start}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_five_clean_stops_leave_nothing_behind_and_the_run_resumes_each_time(tmp_path):
    steep = Steep(tmp_path / "data", free_port(), tmp_path)
    # Someone else's work, named like Steep's: what stops by name (`ray stop --force`,
    # `pkill -f`) would take it too.
    bystander = subprocess.Popen(
        ["bash", "-c", "exec -a 'ray::IDLE rl_core.inference.torch_engine celery' sleep 600"],
        start_new_session=True,
    )
    run_id = ""
    checkpoint = 0  # the run's latest reported checkpoint (step) when it was last stopped
    seen: dict[int, int | None] = {}
    try:
        for cycle in range(CYCLES):
            steep.start(cycle)
            if cycle == 0:
                run_id = create_run(steep)
                wait_for(partial(trains, steep, run_id, checkpointed=True), 300, "a checkpoint")
            else:
                wait_for(partial(trains, steep, run_id), 300, f"training (start {cycle + 1})")
                resumed = steep.db(
                    "SELECT message FROM runs_runevent WHERE run_id = ? AND kind = 'resumed'"
                    " ORDER BY id DESC LIMIT 1",
                    run_id,
                )
                # "Resumed from step N (version V).": from the checkpoint it had, not from 0.
                step = int(resumed[0][0].split("step ")[1].split()[0])
                assert step >= checkpoint > 0, (step, checkpoint)

            now = steeps_processes(steep)
            seen |= now
            assert inference_pid_dir(steep.data_dir).exists() and any(
                inference_pid_dir(steep.data_dir).glob("*.json")
            ), "the run's inference server is recorded"
            os.killpg(steep.process.pid, signal.SIGINT)  # Ctrl-C
            try:
                steep.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail(f"./steep up still running 10 s after Ctrl-C:\n{steep.output()}")

            assert "Traceback" not in steep.output(), steep.output()
            left = _still_running(now)
            assert left == set(), {pid: processes().get(pid) for pid in left}
            assert steeps_processes(steep) == {}
            statuses = dict(steep.db("SELECT id, status FROM runs_run"))
            assert statuses[run_id] == "interrupted", statuses
            failed = steep.db("SELECT name, error FROM runs_run WHERE status = 'failed'")
            assert failed == [], (cycle, failed)
            assert steep.db("SELECT kind FROM runs_runevent WHERE kind = 'status:failed'") == []
            assert steep.db("SELECT max(crash_restarts) FROM runs_run") == [(0,)]
            checkpoint = _checkpoints(steep, run_id)
        assert bystander.poll() is None, "a process Steep did not start was stopped"
    finally:  # after a failure: whatever is left of it, by PID
        bystander.kill()
        bystander.wait(timeout=10)
        if steep.process is not None:
            if steep.process.poll() is None:
                seen |= steeps_processes(steep)
                os.killpg(steep.process.pid, signal.SIGKILL)
                steep.process.wait(timeout=10)
            seen |= steeps_processes(steep)
        stop_local_cluster(data_dir=steep.data_dir)
        for pid, start in seen.items():
            if start is not None and started(pid) == start:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(_ray_temp_dir(steep.data_dir), ignore_errors=True)  # the head's logs


def create_run(steep: Steep) -> str:
    """A run of the demo's task (beside the demo run), long enough never to complete here."""
    wait_for(lambda: steep.check_up() or "API key" in steep.output(), 120, "the demo")
    wait_for(lambda: steep.check_up() or _answers(steep.url), 60, "the web server")
    dataset = steep.rest("GET", "/datasets/")["results"][0]
    demo = steep.rest("GET", "/runs/")["results"][0]
    run = steep.rest(
        "POST",
        "/runs/",
        {
            **TOY_SETTINGS,
            "name": "resumable",
            "mode": "dataset",
            "dataset": dataset["id"],
            "base_model": demo["base_model"],
            "max_steps": 1_000_000,
            "save_every": 2,
        },
    )
    steep.rest("POST", f"/runs/{run['id']}/start/")
    return run["id"].replace("-", "")  # as SQLite holds it


def trains(steep: Steep, run_id: str, *, checkpointed: bool = False) -> bool:
    steep.check_up()
    [(status,)] = steep.db("SELECT status FROM runs_run WHERE id = ?", run_id)
    return status == "running" and (not checkpointed or _checkpoints(steep, run_id) > 0)


def _checkpoints(steep: Steep, run_id: str) -> int:
    [(step,)] = steep.db("SELECT max(step) FROM runs_checkpoint WHERE run_id = ?", run_id)
    return step or 0


def _answers(url: str) -> bool:
    try:
        with DIRECT.open(f"{url}/healthz", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False
