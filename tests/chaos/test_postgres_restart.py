"""PostgreSQL restarted while agents play and the trainer trains: the web process and the run's
job survive it (the gateway answers 503 + Retry-After while the database is down, the job
retries its internal API calls), nothing acknowledged is lost, the run completes and its ledger
is exact.

The stack runs on a PostgreSQL cluster of this test's own (``private_postgres``): the machine's
shared one is never restarted.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.chaos.faults import (
    CHAOS_ENV,
    Agents,
    Chaos,
    assert_acknowledged_kept,
    assert_ledger_exact,
    create_online_run,
    private_postgres,  # noqa: F401 - fixture
    start_and_wait_running,
    wait_finished,
)
from tests.livestack import LiveStack, free_port, run_checked, steep_env

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def pg_stack(private_postgres, tiny_model_dir, tmp_path_factory):  # noqa: F811
    data_dir = tmp_path_factory.mktemp("pg-data")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = steep_env(
        data_dir=data_dir,
        database_url=private_postgres.url,
        site_url=url,
        local_ray=True,
        **CHAOS_ENV,
    )
    with LiveStack(env=env, log_dir=tmp_path_factory.mktemp("pg-logs")) as processes:
        processes.manage("migrate", "--noinput", "-v0")
        out = processes.manage("create_api_key", "--project", "chaos")
        key = out.strip().splitlines()[-1].strip()
        stack = Chaos(url, port, tiny_model_dir, processes, env, data_dir)
        stack.start_web()
        stack.start_worker()
        yield stack, key


def test_a_postgres_restart_loses_nothing_acknowledged(pg_stack, private_postgres):  # noqa: F811
    stack, key = pg_stack
    with httpx.Client(
        base_url=f"{stack.url}/api/v1", headers={"Authorization": f"Bearer {key}"}, timeout=30
    ) as rest:
        run, agent = create_online_run(rest, stack.model_dir, max_steps=6)
        start_and_wait_running(rest, stack, run["id"])
        agents = Agents(agent["base_url"], key, count=3).start()
        try:
            agents.wait_sessions(4)
            private_postgres.stop("fast")  # every connection is cut
            down = time.monotonic()
            # While it is down: a clear, retryable 503 on the REST API and the gateway alike.
            page = rest.get(f"/runs/{run['id']}/")
            assert page.status_code == 503, page.text
            assert page.headers["Retry-After"] == "1"
            assert page.json()["error"]["code"] == "database_unavailable"
            started = httpx.post(
                f"{agent['base_url']}/rl/start_session",
                headers={"Authorization": f"Bearer {key}"},
                json={},
                timeout=30,
            )
            assert started.status_code == 503, started.text
            assert started.headers["Retry-After"] == "1"
            assert started.json()["error"]["code"] == "database_unavailable"
            time.sleep(max(0.0, 3 - (time.monotonic() - down)))  # agents and the job meet it too
            private_postgres.start()
            agents.wait_sessions(len(agents.ended) + 4)
            final = wait_finished(rest, stack, run["id"])
        finally:
            agents.stop()
        assert final["step"] == 6, final
        assert_acknowledged_kept(agents, run["id"], private_postgres.url)
        ledger = assert_ledger_exact(rest, run["id"], steps=6)
        assert ledger["trained"] > 0, ledger
    restarts = run_checked(
        [
            stack.processes.python,
            "manage.py",
            "shell",
            "-c",
            f"from webapp.runs.models import Run; print(Run.objects.get(pk='{run['id']}').crash_restarts)",
        ],
        env=stack.env,
        what="reading the run",
    )
    assert restarts.strip().splitlines()[-1] == "0", "the job rode the outage out"
