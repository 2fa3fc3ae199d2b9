"""An idle run's job asks the internal API a few times a minute, not twice a second: its claim
and its status watch wait in the web app (``webapp.runs.internal``) until there is something
to answer, or until their wait (at most ``INTERNAL_API_LONG_POLL_S``) is over."""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from webapp.runs.jobs import job_secret_issue, job_submit_episodes
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)  # the views check in Django's own thread

EPISODE = {
    "input_ids": [1, 2, 3],
    "output_ids": [4, 5],
    "logprobs": [-0.5, -0.25],
    "versions": [0, 0],
    "reward": 1.0,
}


@pytest.fixture(autouse=True)
async def close_the_views_connection():
    """The test client runs the views' checks in sync_to_async's one thread: its connection
    would outlive the test (and PostgreSQL then refuses to drop the test database)."""
    yield
    await sync_to_async(connections.close_all)()


@pytest.fixture
def running(project, make_run, set_status):
    return set_status(make_run(project), Run.Status.RUNNING)


@pytest.fixture
def job(async_client, running):
    """``await job("claim", body)`` / ``await job("watch?...")``: the run's job calling in."""
    headers = {"Authorization": f"Bearer {job_secret_issue(run=running)}"}
    prefix = f"/internal/v1/runs/{running.id}/"

    async def call(name: str, body: dict | None = None):
        if body is None:
            return await async_client.get(prefix + name, headers=headers)
        return await async_client.post(
            prefix + name, body, content_type="application/json", headers=headers
        )

    return call


async def elsewhere(function, **kwargs):
    """``function`` in a thread and database connection of its own, as another process would:
    the test client serves the request in the one thread sync_to_async would have used."""

    def call():
        try:
            return function(**kwargs)
        finally:
            connections.close_all()

    return await asyncio.to_thread(call)


async def waits(task: asyncio.Task) -> bool:
    """The request is still waiting a moment later (one that answers at once has answered)."""
    await asyncio.sleep(1.0)
    return not task.done()


async def test_a_claim_answers_as_soon_as_a_trajectory_is_ready(job, running, settings):
    settings.INTERNAL_API_LONG_POLL_S = 60
    claim = asyncio.create_task(job("claim", {"limit": 4, "wait_s": 60}))
    assert await waits(claim)

    [session_id] = await elsewhere(job_submit_episodes, run=running, episodes=[EPISODE])

    response = await asyncio.wait_for(claim, timeout=30)  # long before the 60 s wait is over
    assert response.status_code == 200
    assert [item["session_id"] for item in response.json()["sessions"]] == [session_id]


async def test_an_empty_claim_answers_empty_when_its_wait_is_over(job, settings):
    settings.INTERNAL_API_LONG_POLL_S = 0.5  # caps the 60 s asked for
    started = time.monotonic()
    response = await job("claim", {"limit": 4, "wait_s": 60})
    assert response.status_code == 200 and response.json() == {"sessions": [], "unrewarded": 0}
    assert time.monotonic() - started >= 0.5


async def test_a_claim_without_wait_answers_at_once(job, settings):
    settings.INTERNAL_API_LONG_POLL_S = 60
    claim = asyncio.create_task(job("claim", {"limit": 4}))
    response = await asyncio.wait_for(claim, timeout=30)
    assert response.json() == {"sessions": [], "unrewarded": 0}


@pytest.mark.parametrize("wait_s", [-1, "soon", True, float("inf")])
async def test_a_bad_wait_is_400(job, wait_s):
    response = await job("claim", {"limit": 1, "wait_s": wait_s})
    assert response.status_code == 400 and "wait_s" in response.json()["error"]["message"]


async def test_a_watch_answers_when_the_status_changes(job, running, settings):
    settings.INTERNAL_API_LONG_POLL_S = 60
    watch = asyncio.create_task(job("watch?while=running&wait_s=60"))
    assert await waits(watch)

    await elsewhere(Run.objects.filter(pk=running.pk).update, status=Run.Status.STOPPING)

    response = await asyncio.wait_for(watch, timeout=30)
    assert response.status_code == 200 and response.json() == {"status": "stopping"}


async def test_a_watch_answers_the_same_status_when_its_wait_is_over(job, settings):
    settings.INTERNAL_API_LONG_POLL_S = 0.5
    response = await job("watch?while=running&wait_s=60")
    assert response.json() == {"status": "running"}


async def test_a_watch_of_another_status_answers_at_once(job, settings):
    settings.INTERNAL_API_LONG_POLL_S = 60
    response = await asyncio.wait_for(job("watch?while=starting&wait_s=60"), timeout=30)
    assert response.json() == {"status": "running"}


async def test_the_long_polls_need_the_runs_job_secret(async_client, running, job):
    prefix = f"/internal/v1/runs/{running.id}/"
    assert (await async_client.get(prefix + "watch?while=running")).status_code == 401
    response = await async_client.post(prefix + "claim", {}, content_type="application/json")
    assert response.status_code == 401
    assert (await job("claim")).status_code == 405  # a GET: claim is POST
