"""The web process restarted while agents are mid-session (SIGTERM, then SIGKILL): each agent's
next call succeeds or gets a retryable answer (connection refused, which the ``openai`` SDK
retries, or 503 + Retry-After); no acknowledged turn or session end is lost, the run's job
rides it out (its internal API calls are retried) and the run completes with an exact ledger."""

from __future__ import annotations

import signal

import pytest

from tests.chaos.faults import (
    Agents,
    assert_acknowledged_kept,
    assert_ledger_exact,
    create_online_run,
    start_and_wait_running,
    wait_finished,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_agents_and_the_run_ride_out_web_restarts(chaos, rest, api_key):
    from webapp.runs.models import Run

    run, agent = create_online_run(rest, chaos.model_dir, max_steps=6)
    start_and_wait_running(rest, chaos, run["id"])
    agents = Agents(agent["base_url"], api_key, count=4).start()
    try:
        agents.wait_sessions(4)
        chaos.restart_web(signal.SIGTERM)  # a deploy: uvicorn's graceful shutdown
        agents.wait_sessions(len(agents.ended) + 4)
        chaos.restart_web(signal.SIGKILL)  # a crash: requests in flight are cut
        agents.wait_sessions(len(agents.ended) + 4)
        final = wait_finished(rest, chaos, run["id"])
    finally:
        agents.stop()
    assert final["step"] == 6, final
    # The job rode the restarts out: it was never relaunched.
    assert Run.objects.get(pk=run["id"]).crash_restarts == 0
    assert_acknowledged_kept(agents, run["id"])
    ledger = assert_ledger_exact(rest, run["id"], steps=6)
    assert ledger["trained"] > 0, ledger
