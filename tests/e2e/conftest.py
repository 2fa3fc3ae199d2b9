"""A live Steep stack for end-to-end tests: uvicorn (web), a Celery worker with beat,
a local Ray head (started by the worker on free ports) and the runs' Ray jobs, all on
127.0.0.1, sharing the pytest-django test database."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import test_database_url

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], object], timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    data_dir: Path
    model_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def log_tail(self, lines: int = 60) -> str:
        out = []
        for path in self.logs:
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def manage(self, *args: str) -> str:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout


@pytest.fixture(scope="module")
def stack(django_db_setup, django_db_blocker, tmp_path_factory):
    from django.conf import settings

    from rl_core.tiny import build_tiny_model

    data_dir = Path(settings.DATA_DIR)
    model_dir = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="webapp.settings",
        DATA_DIR=str(data_dir),
        DATABASE_URL=test_database_url(),
        SITE_URL=url,
        PYTHONUNBUFFERED="1",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_LOCAL_DASHBOARD_PORT=str(free_port()),
        RAY_LOCAL_GCS_PORT=str(free_port()),
        RAY_NUM_CPUS="4",
        STEEP_TORCH_THREADS="1",
    )
    env.pop("DATABASE_URL_FILE", None)
    if settings.REDIS_URL:
        env["REDIS_URL"] = settings.REDIS_URL
    logs = tmp_path_factory.mktemp("logs")
    stack = Stack(url=url, env=env, data_dir=data_dir, model_dir=model_dir)

    def start(name: str, command: list[str]) -> None:
        path = logs / f"{name}.log"
        stack.logs.append(path)
        handle = open(path, "w")
        stack.procs.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    start(
        "web",
        [
            str(BIN / "uvicorn"),
            "webapp.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--lifespan",
            "off",
            "--log-level",
            "warning",
        ],
    )
    start(
        "worker",
        [
            str(BIN / "celery"),
            "-A",
            "workers",
            "worker",
            "-B",
            "--pool=threads",
            "--concurrency=4",
            "-l",
            "info",
            "--schedule",
            str(logs / "beat-schedule"),
        ],
    )
    try:
        wait_for(lambda: _up(url), 60, "the web server")
        yield stack
    finally:
        for proc in stack.procs:
            proc.terminate()
        for proc in stack.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        with django_db_blocker.unblock():
            from workers.ray_cluster import stop_local_cluster

            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
            stop_local_cluster(data_dir=data_dir)
        shutil.rmtree(data_dir / "runs", ignore_errors=True)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/login/", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
