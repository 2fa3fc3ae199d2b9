"""A run's job retries a claim whose answer it never got (the web process died after the
commit): with the same ``claim_id`` it gets the sessions it claimed, not new ones, so none is
stranded as claimed while the run goes on (``lifecycle.claim``)."""

from __future__ import annotations

import json

import pytest

from webapp.gateway.models import Session
from webapp.runs.jobs import job_claim_trajectories, job_mark_trained, job_secret_issue
from webapp.runs.jobs import job_submit_episodes as submit

pytestmark = pytest.mark.django_db

T = Session.Trajectory


def episodes(group: str, n: int) -> list[dict]:
    return [
        {
            "input_ids": [1, 2, 3],
            "output_ids": [4, 5],
            "logprobs": [-0.5, -0.25],
            "versions": [0, 0],
            "reward": 1.0,
            "group_id": group,
        }
        for _ in range(n)
    ]


@pytest.fixture
def run(project, make_run, set_status):
    return set_status(make_run(project, batch_size=2), "running")


def claimed_ids(run, limit: int, token: str) -> list[str]:
    return [
        item["session_id"] for item in job_claim_trajectories(run=run, limit=limit, token=token)
    ]


def test_a_retried_claim_gets_what_it_claimed(run):
    submit(run=run, episodes=episodes("g1", 4))
    first = claimed_ids(run, 2, "claim-1")
    again = claimed_ids(run, 2, "claim-1")

    assert again == first and len(first) == 2
    assert Session.objects.filter(run=run, trajectory=T.CLAIMED).count() == 2


def test_another_claim_takes_other_sessions(run):
    submit(run=run, episodes=episodes("g1", 4))
    first = claimed_ids(run, 2, "claim-1")
    second = claimed_ids(run, 2, "claim-2")
    assert not set(first) & set(second) and len(second) == 2


def test_once_trained_a_claims_token_takes_new_sessions(run):
    submit(run=run, episodes=episodes("g1", 4))
    first = claimed_ids(run, 2, "claim-1")
    job_mark_trained(run=run, version=1, trained=first, dropped=[])
    later = claimed_ids(run, 2, "claim-1")
    assert len(later) == 2 and not set(later) & set(first)


def test_claims_without_a_token_never_replay(run):
    submit(run=run, episodes=episodes("g1", 4))
    first = claimed_ids(run, 2, "")
    second = claimed_ids(run, 2, "")
    assert not set(first) & set(second)


def test_the_internal_api_refuses_a_claim_id_that_is_not_a_short_string(client, run):
    secret = job_secret_issue(run=run)
    for bad in (7, "x" * 65, ["a"]):
        response = client.post(
            f"/internal/v1/runs/{run.id}/claim",
            data=json.dumps({"limit": 1, "claim_id": bad}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {secret}",
        )
        assert response.status_code == 400, response.content
        assert "claim_id" in response.json()["error"]["message"]
