"""After a crashed run restarts, the version it shows, the weights its servers serve and the
versions on new tokens agree: from its checkpoint's version, or 0 without one."""

from __future__ import annotations

import pytest
from django.urls import reverse

from webapp.gateway.models import Interaction
from webapp.runs import jobs
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Say hi."}]


def trained_to(run, version: int) -> None:
    """The run as a crashed attempt left it: episodes trained up to ``version``."""
    episode = {"input_ids": [1, 2], "output_ids": [3], "logprobs": [-0.5], "versions": [0]}
    jobs.job_submit_episodes(run=run, episodes=[episode | {"reward": 1.0}] * 2)
    claimed = [s["session_id"] for s in jobs.job_claim_trajectories(run=run, limit=2)]
    jobs.job_mark_trained(run=run, version=version, trained=claimed, dropped=[])
    Run.objects.filter(pk=run.pk).update(step=version, weight_version=version)


def new_turn(gw) -> tuple[str, list[int]]:
    session_id, key = gw.start_session()
    answer = gw.openai(key).chat.completions.create(model=gw.model, messages=HI, max_tokens=4)
    turn = Interaction.objects.get(session_id=session_id)
    return answer.system_fingerprint, turn.outputs[0]["versions"]


def test_a_run_restarted_without_a_checkpoint_says_and_serves_version_0(gw, api, member_client):
    trained_to(gw.run, 8)
    # The restarted job found no checkpoint; its fresh servers serve the base weights (v0).
    jobs.job_resume(run=gw.run, step=0, version=0)

    fingerprint, versions = new_turn(gw)
    assert fingerprint == "steep-v0" and set(versions) == {0}
    assert api.get(f"/api/v1/runs/{gw.run.id}/").json()["weight_version"] == 0
    page = member_client.get(reverse("dashboard:run", args=[gw.run.project_id, gw.run.id]))
    html = page.content.decode()
    assert 'version <b data-live="version">0</b>' in html
    assert "Restarted from version 0: no checkpoint was saved. The run was at version 8." in html


def test_a_run_restarted_from_a_checkpoint_serves_and_says_its_version(
    gw, api, engine, load_weights, tiny_model_dir, perturbed_model_dir
):
    trained_to(gw.run, 5)
    # The job restored the checkpoint of step 3 and pushed its weights before resuming.
    load_weights(engine, perturbed_model_dir, 3)
    try:
        jobs.job_resume(run=gw.run, step=3, version=3)
        fingerprint, versions = new_turn(gw)
    finally:
        load_weights(engine, tiny_model_dir, 0)
    assert fingerprint == "steep-v3" and set(versions) == {3}
    assert api.get(f"/api/v1/runs/{gw.run.id}/").json()["weight_version"] == 3
