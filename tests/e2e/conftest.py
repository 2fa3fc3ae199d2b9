"""A live Steep stack for end-to-end tests: uvicorn (web), a Celery worker with beat,
a local Ray head (started by the worker on free ports) and the runs' Ray jobs, all on
127.0.0.1, sharing the pytest-django test database (started by ``tests/livestack.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import test_database_url
from tests.livestack import LiveStack, answers, free_port, steep_env


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
