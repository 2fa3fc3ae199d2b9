"""An inference server (the run's torch engine) killed mid-run while agents play: the gateway
fails over or answers 503 with Retry-After, the job starts the server again with the current
policy, the run completes and its ledger is exact (``workers.ray_job.watch_servers``)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.chaos.faults import (
    Agents,
    assert_acknowledged_kept,
    assert_ledger_exact,
    create_online_run,
    start_and_wait_running,
    wait_finished,
    wait_step,
)
from tests.livestack import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_killed_inference_server_is_restarted_and_the_run_completes(chaos, rest, api_key):
    from webapp.runs.models import RunEvent

    run, agent = create_online_run(rest, chaos.model_dir, max_steps=6)
    start_and_wait_running(rest, chaos, run["id"])
    agents = Agents(agent["base_url"], api_key, count=3).start()
    try:
        wait_step(rest, chaos, run["id"], 2)
        [server] = chaos.inference_servers()
        os.killpg(server["pid"], signal.SIGKILL)

        def restarted():
            return RunEvent.objects.filter(
                run_id=run["id"], kind="inference", message__contains="restarted"
            ).first()

        event = wait_for(restarted, 300, f"the server's restart\n{chaos.log_tail()}")
        assert server["url"] in event.message
        final = wait_finished(rest, chaos, run["id"])
    finally:
        agents.stop()
    assert final["step"] == 6, final
    assert RunEvent.objects.filter(
        run_id=run["id"], kind="inference", message__contains=f"{server['url']} exited"
    ).exists()
    assert_acknowledged_kept(agents, run["id"])
    ledger = assert_ledger_exact(rest, run["id"], steps=6)
    assert ledger["trained"] > 0, ledger
