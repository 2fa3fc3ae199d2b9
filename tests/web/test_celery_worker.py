"""A real Celery worker process runs a run's lifecycle tasks from the real broker.

The broker is Redis when REDIS_URL is set, otherwise kombu's file-system transport
under DATA_DIR/broker; the worker shares this test's database (SQLite file or
Postgres), so the test uses real transactions and sees the worker's writes.

The worker is pointed at a Ray address where nothing listens: it must never start a
Ray head from a test, and a launch then fails the run with a readable error.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from webapp.runs.models import Run, RunEvent

ROOT = Path(__file__).resolve().parents[2]
CELERY = Path(sys.executable).with_name("celery")
FINAL = {Run.Status.FAILED, Run.Status.STOPPED, Run.Status.COMPLETED, Run.Status.RUNNING}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def worker(subprocess_env, tmp_path):
    log = tmp_path / "worker.log"
    env = subprocess_env | {"RAY_ADDRESS": f"http://127.0.0.1:{closed_port()}"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                str(CELERY),
                "-A",
                "workers",
                "worker",
                "--pool=solo",
                "--concurrency=1",
                "-Q",
                "celery",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
                "-l",
                "info",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    process.log = log
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=3)
        except subprocess.TimeoutExpired:  # it lingers in interpreter shutdown; nothing is pending
            process.kill()
            process.wait(timeout=5)


def wait_until(worker, done, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done():
        assert worker.poll() is None, worker.log.read_text()[-4000:]
        time.sleep(0.2)
    return worker.log.read_text()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_worker_picks_up_start_and_stop_requests(api, project, make_run, set_status, worker):
    from webapp.runs.tasks import run_launch

    assert not run_launch.app.conf.task_always_eager  # the worker, not this process, runs them
    started = make_run(project, name="started")
    stopped = set_status(make_run(project, name="stopped"), Run.Status.QUEUED)

    response = api.post(f"/api/v1/runs/{started.id}/start/")
    assert response.status_code == 202 and response.json()["status"] == "queued"
    response = api.post(f"/api/v1/runs/{stopped.id}/stop/")
    assert response.status_code == 202 and response.json()["status"] == "stopping"

    def settled() -> bool:
        statuses = dict(Run.objects.values_list("name", "status"))
        return statuses["started"] in FINAL and statuses["stopped"] in FINAL

    log = wait_until(worker, settled)
    assert settled(), log[-4000:]
    assert "runs.launch" in log and "runs.shutdown" in log

    started.refresh_from_db()
    kinds = list(started.events.order_by("id").values_list("kind", flat=True))
    assert kinds[:3] == ["created", "status:queued", "status:starting"], kinds
    assert "worker" in RunEvent.objects.get(run=started, kind="status:starting").message
    # No Ray cluster answers, so the launch fails the run and says why.
    assert started.status == Run.Status.FAILED, (started.status, started.error)
    assert "Ray" in started.error and started.finished_at is not None

    stopped.refresh_from_db()
    assert stopped.status == Run.Status.STOPPED and stopped.finished_at is not None
    assert (
        list(stopped.events.order_by("id").values_list("kind", flat=True))[-1] == "status:stopped"
    )
