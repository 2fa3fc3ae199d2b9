"""A live Steep stack for end-to-end tests: uvicorn (web), a Celery worker with beat,
a local Ray head (started by the worker on free ports) and the runs' Ray jobs, all on
127.0.0.1, sharing the pytest-django test database (started by ``tests/livestack.py``)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import test_database_url
from tests.livestack import ROOT, LiveStack, answers, free_port, steep_env


@dataclass
class Stack:
    url: str
    model_dir: Path
    processes: LiveStack

    def log_tail(self, lines: int = 60) -> str:
        return self.processes.log_tail(lines)


@pytest.fixture(scope="module")
def stack(django_db_setup, tmp_path_factory):
    from django.conf import settings

    from rl_core.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = steep_env(
        data_dir=settings.DATA_DIR,
        database_url=test_database_url(),
        redis_url=settings.REDIS_URL,
        site_url=url,
        local_ray=True,
        STEEP_JUDGE_INTERVAL_S="2",  # a judged run (test_training_runs.py) is scored sooner
    )
    with LiveStack(env=env, log_dir=tmp_path_factory.mktemp("logs")) as processes:
        web = processes.start_web(port)
        processes.start_worker()
        processes.wait_ready(web, lambda: answers(f"{url}/login/"), what="the web server")
        yield Stack(url=url, model_dir=model_dir, processes=processes)


@pytest.fixture
def rest(stack, api_key):
    """The stack's REST API as the project's key."""
    import httpx

    with httpx.Client(
        base_url=f"{stack.url}/api/v1", headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    ) as client:
        yield client


@contextmanager
def steep_up_stack(
    tmp_path_factory, before_worker: Callable[[], None] = lambda: None, **extra_env: str
) -> Iterator[tuple[LiveStack, Path, str]]:
    """./steep up's stack: its prepare() (migrate, the tiny model, bootstrap_demo --start),
    ``before_worker()``, then its worker and web server, with ``extra_env`` on top; yields
    (the stack, its DATA_DIR, what prepare printed). Needs the transactional test database."""
    data_dir = tmp_path_factory.mktemp("steep-up-data")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = steep_env(
        data_dir=data_dir,
        database_url=test_database_url(),
        site_url=url,
        local_ray=True,
        **extra_env,
    )
    with LiveStack(env=env, log_dir=tmp_path_factory.mktemp("steep-up-logs")) as stack:
        model = data_dir / "models" / "tiny-chat"
        stack.manage("migrate", "--noinput", "-v0")
        subprocess.run(
            [sys.executable, "-m", "rl_core.tiny", str(model)], env=env, cwd=ROOT, check=True
        )
        printed = stack.manage("bootstrap_demo", "--start", "--model", str(model))
        before_worker()
        stack.start_worker()
        web = stack.start_web(port)
        stack.wait_ready(web, lambda: answers(f"{url}/login/"), what="the web server")
        yield stack, data_dir, printed


def demo_env(data_dir: Path) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(.*)$", (data_dir / "demo.env").read_text(), re.M))


def dashboard_login(url: str, data_dir: Path):
    """A browser session of ``./steep up``'s admin (its printed password), CSRF included."""
    import httpx

    browser = httpx.Client(base_url=url, timeout=30)
    browser.get("/login/").raise_for_status()
    password = (data_dir / "admin-password.txt").read_text().strip()
    form = {"username": "admin", "password": password}
    assert dashboard_post(browser, "/login/", form).status_code == 302
    return browser


def dashboard_post(browser, path: str, data: dict, **kwargs):
    """POST a dashboard form as the browser does, with its CSRF token."""
    token = browser.cookies["csrftoken"]
    return browser.post(path, data={**data, "csrfmiddlewaretoken": token}, **kwargs)
