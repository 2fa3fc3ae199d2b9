"""A run's job retries a submission whose answer it never got (the web process restarted after
the commit): the episodes are recorded once (``jobs.job_submit_episodes``)."""

from __future__ import annotations

import pytest

from webapp.gateway.models import Interaction, Session
from webapp.runs.jobs import job_submit_episodes
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db


def group(group_id: str, size: int = 2) -> list[dict]:
    return [
        {
            "input_ids": [1, 2, 3],
            "output_ids": [4, 5 + member],
            "logprobs": [-0.5, -0.25],
            "versions": [0, 0],
            "reward": float(member),
            "group_id": group_id,
        }
        for member in range(size)
    ]


def test_a_resubmitted_group_is_recorded_once(project, make_run):
    run = make_run(project)
    first = job_submit_episodes(run=run, episodes=group("g1"))
    again = job_submit_episodes(run=run, episodes=group("g1"))

    assert again == first
    assert Session.objects.filter(run=run).count() == 2
    assert Interaction.objects.filter(session__run=run).count() == 2
    assert Run.objects.get(pk=run.pk).sessions_accepted == 2


def test_a_retry_that_carries_new_episodes_records_only_those(project, make_run):
    run = make_run(project)
    job_submit_episodes(run=run, episodes=group("g1"))
    ids = job_submit_episodes(run=run, episodes=group("g1", size=3))

    assert len(set(ids)) == 3
    assert Session.objects.filter(run=run).count() == 3


def test_groups_and_runs_never_share_a_session(project, make_run):
    run, other = make_run(project), make_run(project, name="other")
    a = job_submit_episodes(run=run, episodes=group("g1"))
    b = job_submit_episodes(run=run, episodes=group("g2"))
    c = job_submit_episodes(run=other, episodes=group("g1"))
    assert len(set(a + b + c)) == 6


def test_episodes_without_a_group_are_each_new(project, make_run):
    run = make_run(project)
    episodes = [{k: v for k, v in e.items() if k != "group_id"} for e in group("")]
    job_submit_episodes(run=run, episodes=episodes)
    job_submit_episodes(run=run, episodes=episodes)
    assert Session.objects.filter(run=run).count() == 4
