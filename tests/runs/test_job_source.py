"""A run's job takes its trajectories from the web app (``workers.job_api.WebSource``): a batch
fills up as trajectories become ready, each claim waiting in the web app meanwhile."""

from __future__ import annotations

import asyncio

import pytest
from django.db import connections

from webapp.runs.jobs import job_secret_issue, job_submit_episodes
from webapp.runs.models import Run
from workers.job_api import InternalAPI, WebSource

pytestmark = pytest.mark.django_db(transaction=True)  # the live server sees committed rows

EPISODE = {
    "input_ids": [1, 2, 3],
    "output_ids": [4, 5],
    "logprobs": [-0.5, -0.25],
    "versions": [0, 0],
    "reward": 1.0,
}


def submit(run: Run) -> list[str]:
    try:
        return job_submit_episodes(run=run, episodes=[EPISODE])
    finally:
        connections.close_all()  # a thread of its own: its own connection


@pytest.fixture
def run(project, make_run, set_status) -> Run:
    return set_status(make_run(project), Run.Status.RUNNING)


@pytest.fixture
def secret(run) -> str:
    return job_secret_issue(run=run)


async def test_a_batch_fills_up_as_trajectories_become_ready(live_server, run, secret, settings):
    settings.INTERNAL_API_LONG_POLL_S = 60
    api = InternalAPI(live_server.url, str(run.id), secret)
    try:
        batch = asyncio.create_task(WebSource(api).next_batch(2))
        first = await asyncio.to_thread(submit, run)
        await asyncio.sleep(1.0)
        assert not batch.done(), "one of two is not a batch"
        second = await asyncio.to_thread(submit, run)

        got = await asyncio.wait_for(batch, timeout=30)
    finally:
        await api.aclose()
    assert [key for key, _ in got] == [f"{first[0]}#0", f"{second[0]}#0"]
    assert [trajectory.rewards for _, trajectory in got] == [[1.0], [1.0]]
