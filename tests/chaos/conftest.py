"""The chaos tests' shared stack: one live Steep (web, Celery worker + beat, a local Ray head,
the runs' jobs with the tiny model on the torch engine) for the whole folder, on the
pytest-django test database (``tests/chaos/faults.py`` has the harness and the checks).

It is started once, by the first test that asks for it, and each test leaves it running: a
test that kills the worker or the web process starts it again before it ends, and every test
waits for its own run to finish. Starting it once instead of once per test saves a web
server, a worker and a Ray head per test (minutes of a CI run on two cores).
``STEEP_FAILPOINTS`` points at a file a test arms (``chaos.arm([...])``); nothing is armed
unless a test does it, and each entry fires once.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rl_core.failpoints import arm
from tests.chaos.faults import Chaos, chaos_env
from tests.livestack import LiveStack, free_port


@pytest.fixture(scope="package")
def chaos(django_db_setup, tmp_path_factory, tiny_model_dir):
    from django.conf import settings

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data_dir = Path(settings.DATA_DIR)
    failpoints = tmp_path_factory.mktemp("chaos") / "failpoints.json"
    arm(failpoints, [])
    env = chaos_env(data_dir, url, STEEP_FAILPOINTS=str(failpoints))
    with LiveStack(env=env, log_dir=tmp_path_factory.mktemp("chaos-logs")) as processes:
        stack = Chaos(url, port, tiny_model_dir, processes, env, data_dir, failpoints)
        stack.start_web()
        stack.start_worker()
        yield stack


@pytest.fixture
def rest(chaos, api_key):
    with httpx.Client(
        base_url=f"{chaos.url}/api/v1", headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    ) as client:
        yield client
