"""A dataset run's job gives back the staleness slots of episodes that will never be rewarded
(a verdict that failed its schema, a human reward that never came): the web app tells it once,
in the claim answer, and the controller frees them without counting stale drops."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from rl_core.staleness import StalenessController
from webapp.rewards.services import rewards_tick
from webapp.runs.jobs import job_secret_issue, job_submit_episodes
from webapp.runs.models import Run
from workers.job_api import InternalAPI, WebSource


def test_unrewarded_episodes_free_their_slots_and_are_not_stale_drops():
    controller = StalenessController(max_staleness=0, batch_size=2)
    for _ in range(2):
        assert controller.try_admit()
        controller.on_finish(accepted=True)
    assert not controller.try_admit()  # the budget is full until a step, or a give-back
    controller.on_unrewarded(1)
    assert controller.try_admit()
    assert controller.dropped == 0 and controller.accepted == 1
    controller.on_unrewarded(5)  # a report larger than what is accepted (a resumed job): clamped
    assert controller.accepted == 0


def _episode(answer: str) -> dict:
    return {
        "input_ids": [1, 2],
        "output_ids": [3],
        "logprobs": [-0.1],
        "versions": [0],
        "reward": None,
        "text": answer,
        "messages": [{"role": "user", "content": "2+2?"}],
        "group_id": answer,
    }


@pytest.mark.django_db(transaction=True)  # the live server sees committed rows
async def test_the_claim_answer_tells_the_job_once_how_many_went_unscored(
    live_server, project, make_dataset, make_run, set_status, judge_spec, judge_server, settings
):
    settings.INTERNAL_API_LONG_POLL_S = 0
    judge_server.mode = "garbage"

    def setup():
        try:
            run = make_run(project, dataset=make_dataset(project), reward=judge_spec, group_size=1)
            run = set_status(run, Run.Status.RUNNING)
            job_submit_episodes(run=run, episodes=[_episode("4"), _episode("5")])
            rewards_tick()
            return run, job_secret_issue(run=run)
        finally:
            connections.close_all()  # a thread of its own: its own connection

    run, secret = await sync_to_async(setup)()
    told: list[int] = []
    api = InternalAPI(live_server.url, str(run.id), secret)
    try:
        source = WebSource(api, wait_s=0)

        def tell(n: int) -> None:
            told.append(n)
            source.stop()  # nothing is ready to train: end the batch here

        source.on_unrewarded = tell
        assert await asyncio.wait_for(source.next_batch(1), timeout=30) == []
        assert told == [2]
        again = await api.call("POST", "claim", {"limit": 1, "wait_s": 0})
        assert again == {"sessions": [], "unrewarded": 0}  # told once
    finally:
        await api.aclose()
