"""A run's ledger (``webapp.runs.ledger``, ``GET /api/v1/runs/<id>/ledger/``) and the rewind
on resume (``jobs.job_resume``): what was trained after the checkpoint is trained again."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from webapp.accounts.services import api_key_create
from webapp.gateway.models import Session, TrainingRecord
from webapp.runs import jobs
from webapp.runs.ledger import run_ledger
from webapp.runs.models import Checkpoint, MetricPoint, Run, RunEvent

pytestmark = pytest.mark.django_db
T = Session.Trajectory


@pytest.fixture
def run(project, make_run, set_status):
    return set_status(make_run(project, batch_size=2, max_staleness=4), Run.Status.RUNNING)


def submit(run, n: int, *, row: int = 0, group: str = "g") -> list[str]:
    episode = {
        "input_ids": [1, 2],
        "output_ids": [3],
        "logprobs": [-0.5],
        "versions": [0],
        "reward": 1.0,
        "group_id": group,
        "metadata": {"row_index": row},
    }
    return jobs.job_submit_episodes(run=run, episodes=[episode] * n)


def train_step(run, version: int, n: int = 2, dropped: int = 0) -> list[str]:
    """Claim ``n + dropped`` ready sessions; train ``n`` into ``version``, drop the rest."""
    claimed = [
        item["session_id"] for item in jobs.job_claim_trajectories(run=run, limit=n + dropped)
    ]
    jobs.job_mark_trained(run=run, version=version, trained=claimed[:n], dropped=claimed[n:])
    return claimed[:n]


def states(ids) -> list[str]:
    by_id = {str(pk): t for pk, t in Session.objects.values_list("pk", "trajectory")}
    return [by_id[str(i)] for i in ids]


def test_the_ledger_counts_every_state_and_balances(run):
    submit(run, 7)
    first = train_step(run, version=1)
    train_step(run, version=2, n=2, dropped=1)
    jobs.job_claim_trajectories(run=run, limit=1)  # one claimed, one ready left

    ledger = run_ledger(run)
    assert ledger["run"] == str(run.id)
    assert (ledger["accepted"], ledger["trained"], ledger["dropped"], ledger["pending"]) == (
        7,
        4,
        1,
        2,
    )
    assert (ledger["ready"], ledger["claimed"]) == (1, 1)
    assert ledger["trained_by_step"] == [{"step": 1, "count": 2}, {"step": 2, "count": 2}]
    assert ledger["dropped_by_reason"] == {"stale": 1}
    assert ledger["trained_twice"] == [] and ledger["balanced"] is True
    assert states(first) == [T.TRAINED, T.TRAINED]


def test_a_retried_trained_report_records_nothing_twice(run):
    submit(run, 2)
    trained = train_step(run, version=1)
    jobs.job_mark_trained(run=run, version=1, trained=trained, dropped=[])  # the retry
    assert TrainingRecord.objects.filter(run=run).count() == 2
    assert run_ledger(run)["balanced"] is True


def test_a_session_trained_twice_unbalances_the_ledger(run):
    submit(run, 2)
    trained = train_step(run, version=1)
    TrainingRecord.objects.create(run=run, session_id=trained[0], version=2)
    ledger = run_ledger(run)
    assert ledger["trained_twice"] == [trained[0]] and ledger["balanced"] is False


def test_resume_trains_again_what_was_trained_after_the_checkpoint(run):
    submit(run, 9)
    kept = train_step(run, version=1) + train_step(run, version=2)
    lost = train_step(run, version=3) + train_step(run, version=4)
    claimed = [item["session_id"] for item in jobs.job_claim_trajectories(run=run, limit=1)]
    for step in range(1, 5):
        MetricPoint.objects.create(run=run, step=step, name="rollout/reward", value=0.5)
    Checkpoint.objects.create(run=run, version=2, step=2, path="/ckpt/2")
    Checkpoint.objects.create(run=run, version=4, step=4, path="/ckpt/4")
    Run.objects.filter(pk=run.pk).update(step=4, weight_version=4)

    answer = jobs.job_resume(run=run, step=2, version=2)

    assert (answer["released"], answer["rewound"]) == (1, 4)
    assert states(kept) == [T.TRAINED] * 4
    assert states(lost + claimed) == [T.READY] * 5
    run.refresh_from_db()
    assert (run.step, run.weight_version) == (2, 2)
    assert answer["accepted"] == run.sessions_accepted == 9  # none was dropped
    assert sorted(MetricPoint.objects.filter(run=run).values_list("step", flat=True)) == [1, 2]
    assert list(Checkpoint.objects.filter(run=run).values_list("version", flat=True)) == [2]
    ledger = run_ledger(run)
    assert ledger["trained_by_step"] == [{"step": 1, "count": 2}, {"step": 2, "count": 2}]
    assert (ledger["trained"], ledger["pending"], ledger["balanced"]) == (4, 5, True)
    assert "Restarted from checkpoint of step 2 (version 2)" in RunEvent.objects.last().message

    # Trained again in the new lineage: each session once.
    for version in (3, 4, 5):
        train_step(run, version=version)
    train_step(run, version=6, n=1)
    ledger = run_ledger(run)
    assert (ledger["trained"], ledger["pending"]) == (9, 0)
    assert ledger["trained_twice"] == [] and ledger["balanced"]
    assert [r["count"] for r in ledger["trained_by_step"]] == [2, 2, 2, 2, 1]


def test_resume_without_a_checkpoint_starts_the_run_again_from_version_0(run):
    submit(run, 4)
    train_step(run, version=1)
    train_step(run, version=2, n=1, dropped=1)
    Run.objects.filter(pk=run.pk).update(step=2, weight_version=2)
    answer = jobs.job_resume(run=run, step=0, version=0)
    run.refresh_from_db()
    assert (run.step, run.weight_version, answer["rewound"]) == (0, 0, 3)
    ledger = run_ledger(run)
    # The drop stays a drop: it was a decision, not training. The job's staleness counter
    # resumes from it, so the run's dropped_total series agrees with the ledger.
    assert (ledger["trained"], ledger["dropped"], ledger["pending"]) == (0, 1, 3)
    assert answer["dropped"] == ledger["dropped_by_reason"]["stale"] == 1
    assert ledger["trained_by_step"] == [] and ledger["balanced"]
    event = RunEvent.objects.last().message
    assert "Restarted from version 0" in event and "was at version 2" in event


def test_resume_counts_each_dataset_row_by_its_groups(project, make_run, make_dataset, set_status):
    run = set_status(
        make_run(project, dataset=make_dataset(project), batch_size=2, group_size=2),
        Run.Status.RUNNING,
    )
    submit(run, 2, row=3, group="a")
    submit(run, 2, row=3, group="b")
    submit(run, 2, row=0, group="c")
    assert jobs.job_resume(run=run, step=0, version=0)["rows_used"] == {0: 1, 3: 2}


# --- The endpoint --------------------------------------------------------------------------


def test_the_ledger_endpoint_answers_the_ledger(api, run):
    submit(run, 3)
    train_step(run, version=1)
    response = api.get(f"/api/v1/runs/{run.id}/ledger/")
    assert response.status_code == 200
    body = response.json()
    assert body == run_ledger(run)
    for key in ("accepted", "trained", "dropped", "aborted", "pending"):
        assert isinstance(body[key], int)
    assert body["trained_by_step"] == [{"step": 1, "count": 2}]
    assert body["dropped_by_reason"] == {} and body["trained_twice"] == []
    assert body["balanced"] is True


def test_ledger_of_other_projects_run_is_404(other_api, run, api_error):
    api_error(other_api.get(f"/api/v1/runs/{run.id}/ledger/"), 404)


@pytest.mark.parametrize("run_id", ["00000000-0000-0000-0000-000000000000", "not-a-uuid"])
def test_ledger_of_unknown_run_is_404(api, run_id, api_error):
    api_error(api.get(f"/api/v1/runs/{run_id}/ledger/"), 404)


def test_ledger_with_an_expired_key_is_401(anon_api, project, run, api_error):
    _, key = api_key_create(project=project, expires_at=timezone.now() - timedelta(seconds=1))
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    api_error(anon_api.get(f"/api/v1/runs/{run.id}/ledger/"), 401)
    anon_api.credentials()
    api_error(anon_api.get(f"/api/v1/runs/{run.id}/ledger/"), 401)


def test_ledger_refuses_writes(api, run):
    assert api.post(f"/api/v1/runs/{run.id}/ledger/", {}, format="json").status_code == 405


# --- The run page --------------------------------------------------------------------------


def page(client, run) -> str:
    from django.urls import reverse

    return client.get(reverse("dashboard:run", args=[run.project_id, run.id])).content.decode()


def test_the_run_page_has_the_ledger_line(member_client, run):
    submit(run, 5)
    train_step(run, version=1)
    train_step(run, version=2, n=1, dropped=1)
    html = page(member_client, run)
    assert (
        "Trajectories: <b>5</b> accepted · <b>3</b> trained · <b>1</b> dropped (1 stale)"
        " · <b>1</b> pending"
    ) in html
    assert '<span class="ok">balanced</span>' in html
    assert f"/api/v1/runs/{run.id}/ledger/?project={run.project_id}" in html


def test_a_costly_ledger_is_kept_for_the_polled_page_and_says_as_of_when(
    member_client, api, run, monkeypatch
):
    from django.core.cache import cache

    from webapp.runs import ledger

    submit(run, 3)
    monkeypatch.setattr(ledger, "CACHE_ABOVE_S", 1e6)  # as if it were cheap, however slow now
    assert "as of" not in page(member_client, run)  # cheap: computed at every poll
    monkeypatch.setattr(ledger, "CACHE_ABOVE_S", 0.0)  # as if it cost enough to keep
    monkeypatch.setattr(ledger, "CACHE_COST_FACTOR", 1e6)
    try:
        first = page(member_client, run)
        submit(run, 2, row=1, group="h")  # two more accepted: the kept line does not see them
        kept = page(member_client, run)
        assert "Trajectories: <b>3</b> accepted" in first and "(as of " in first
        assert "Trajectories: <b>3</b> accepted" in kept
        url = f"/api/v1/runs/{run.id}/ledger/"
        assert api.get(url).json()["accepted"] == 5  # the REST ledger is always computed
    finally:
        cache.clear()
    assert "Trajectories: <b>5</b> accepted" in page(member_client, run)


def test_the_ledger_link_works_in_the_browser(member_client, run):
    response = member_client.get(f"/api/v1/runs/{run.id}/ledger/?project={run.project_id}")
    assert response.status_code == 200 and response.json()["balanced"] is True


def test_the_run_page_says_it_restarted_from_version_0(member_client, run):
    submit(run, 2)
    train_step(run, version=1)
    Run.objects.filter(pk=run.pk).update(step=1, weight_version=1)
    assert "Restarted" not in page(member_client, run)
    jobs.job_resume(run=run, step=0, version=0)
    html = page(member_client, run)
    assert 'version <b data-live="version">0</b>' in html
    assert "Restarted from version 0: no checkpoint was saved. The run was at version 1." in html


def test_a_first_start_is_not_a_restart(run):
    answer = jobs.job_resume(run=run, step=0, version=0)
    assert answer["message"] == "Training starts from version 0."
    assert not RunEvent.objects.filter(run=run, kind=RunEvent.RESUME).exists()
