"""Eval runs over REST: the base model and a checkpoint really scored (``python -m
rl_core.evaluate`` in the eagerly run task) on the run's held-out rows, progress and 95%
intervals, per-example results, the eval/* chart series, scheduling every eval_every steps
without holding the job's reports up, and bad input on every eval endpoint."""

from __future__ import annotations

import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from rl_core.evals import split_rows
from rl_core.toy import TOY_REWARD, toy_rows
from webapp.accounts.services import api_key_create
from webapp.evals.models import Eval, EvalExample
from webapp.runs.jobs import job_report_checkpoint, job_report_metrics
from webapp.runs.models import Checkpoint, MetricPoint

pytestmark = pytest.mark.django_db

ROWS = toy_rows(16, seed=5)


@pytest.fixture
def eager(monkeypatch, settings):
    from webapp.evals.tasks import eval_execute

    monkeypatch.setitem(eval_execute.app.conf, "task_always_eager", True)
    settings.STEEP_TORCH_THREADS = 1


@pytest.fixture
def world(
    settings, tmp_path, project, other_project, make_dataset, make_run, tiny_model_dir,
    perturbed_model_dir,
):  # fmt: skip
    settings.DATA_DIR = tmp_path / "data"
    dataset = make_dataset(project, name="letters", rows=ROWS)
    settings = {
        "base_model": str(tiny_model_dir),
        "reward": TOY_REWARD,
        "max_new_tokens": 6,
        "eval_fraction": 0.25,
        "eval_k": 3,
        "eval_pass_threshold": 0.25,
    }
    run = make_run(project, name="toy", dataset=dataset, **settings)
    checkpoint = Checkpoint.objects.create(
        run=run, version=4, step=4, path=str(perturbed_model_dir)
    )
    other_run = make_run(other_project, name="rival", dataset=make_dataset(other_project))
    return SimpleNamespace(dataset=dataset, run=run, checkpoint=checkpoint, other_run=other_run)


def evals_url(run, tail: str = "") -> str:
    return f"/api/v1/runs/{run.id}/evals/{tail}"


@pytest.mark.slow
def test_base_model_and_checkpoint_are_scored_on_the_held_out_rows(
    api, world, eager, django_capture_on_commit_callbacks
):
    held = split_rows(ROWS, 0.25, seed=0)[1]
    with django_capture_on_commit_callbacks(execute=True):
        response = api.post(
            evals_url(world.run),
            {"base_model": True, "checkpoints": [world.checkpoint.id]},
            format="json",
        )
    assert response.status_code == 201, response.content[:500]
    created = response.json()
    assert [(e["model"], e["step"], e["status"]) for e in created] == [
        ("base model", 0, "queued"),
        ("step 4", 4, "queued"),
    ]
    for item in created:
        body = api.get(evals_url(world.run, f"{item['id']}/")).json()
        assert body["status"] == "done", body["error"]
        assert body["split"] == "held_out" and body["k"] == 3
        assert body["progress_done"] == body["progress_total"] == body["examples"] == len(held)
        low, high = body["mean_reward_ci"]
        assert low <= body["mean_reward"] <= high
        low, high = body["pass_at_k_ci"]
        assert low <= body["pass_at_k"] <= high
        page = api.get(evals_url(world.run, f"{item['id']}/examples/")).json()
        assert page["count"] == len(held)
        first = page["results"][0]
        assert first["messages"] == [{"role": "user", "content": held[0]["prompt"]}]
        assert first["answer"] == "v"
        assert len(first["completions"]) == len(first["rewards"]) == 3
        assert first["mean_reward"] == pytest.approx(sum(first["rewards"]) / 3)
        evaluation = Eval.objects.get(pk=item["id"])
        assert evaluation.mean_reward == pytest.approx(
            sum(e.mean_reward for e in EvalExample.objects.filter(eval=evaluation)) / len(held)
        )
        worst = api.get(evals_url(world.run, f"{item['id']}/examples/?order=worst")).json()
        means = [r["mean_reward"] for r in worst["results"]]
        assert means == sorted(means)
    # Each held-out eval is a point of the run's eval series at its step.
    series = dict(
        MetricPoint.objects.filter(run=world.run, name="eval/mean_reward").values_list(
            "step", "value"
        )
    )
    assert set(series) == {0, 4}
    assert series[4] == pytest.approx(Eval.objects.get(step=4).mean_reward)


@pytest.mark.slow
def test_a_scheduled_eval_is_queued_and_the_job_keeps_reporting_steps(
    world, eager, django_capture_on_commit_callbacks, set_status
):
    run = world.run
    run.config |= {"eval_every": 2}
    run.save(update_fields=["config"])
    set_status(run, "running")
    with django_capture_on_commit_callbacks(execute=False) as queued:
        checkpoint = job_report_checkpoint(
            run=run, version=2, step=2, path=str(world.checkpoint.path), size_bytes=1
        )
        # The job reports its next steps while the eval has not even started.
        for step in (3, 4, 5):
            job_report_metrics(run=run, step=step, version=step, metrics={"rollout/reward": 0.1})
        job_report_checkpoint(
            run=run, version=3, step=3, path=str(world.checkpoint.path), size_bytes=1
        )
    run.refresh_from_db()
    assert run.step == 5
    (scheduled,) = Eval.objects.filter(run=run, scheduled=True)
    assert (scheduled.checkpoint, scheduled.status, scheduled.max_examples) == (
        checkpoint,
        "queued",
        100,
    )
    for callback in queued:
        callback()  # what the worker does meanwhile
    scheduled.refresh_from_db()
    assert scheduled.status == "done", scheduled.error
    # Reported again (a retried report): not evaluated twice.
    job_report_checkpoint(run=run, version=2, step=2, path=str(world.checkpoint.path), size_bytes=1)
    assert Eval.objects.filter(run=run, scheduled=True).count() == 1


def test_an_eval_samples_with_the_runs_temperature_and_top_p(api, world, make_run, member_client):
    run = make_run(
        world.run.project,
        name="nucleus",
        dataset=world.dataset,
        **(world.run.config | {"temperature": 0.7, "top_p": 0.5}),
    )
    response = api.post(evals_url(run), {"base_model": True}, format="json")
    assert response.status_code == 201, response.content[:500]
    (created,) = response.json()
    assert (created["temperature"], created["top_p"]) == (0.7, 0.5)
    assert Eval.objects.get(pk=created["id"]).top_p == 0.5
    page = member_client.get(f"/projects/{run.project_id}/runs/{run.id}/evals/{created['id']}/")
    assert "sampled at temperature 0.7, top-p 0.5" in page.content.decode()


def test_an_eval_whose_checkpoint_files_are_gone_is_409(api, world, api_error):
    gone = Checkpoint.objects.create(run=world.run, version=9, step=9, path="/nowhere/step_9")
    error = api_error(
        api.post(evals_url(world.run), {"checkpoints": [gone.id]}, format="json"), 409
    )
    assert "gone" in error["message"]
    assert not Eval.objects.exists()


def test_eval_input_is_validated(api, world, other_project, make_dataset, api_error):
    url = evals_url(world.run)
    cases = [
        ({}, None),  # no model named
        ({"base_model": True, "k": 0}, "k"),
        ({"base_model": True, "k": "many"}, "k"),
        ({"base_model": True, "split": "test"}, "split"),
        ({"base_model": True, "bogus": 1}, "bogus"),
        ({"checkpoints": [999999]}, "checkpoints"),
        ({"checkpoints": "4"}, "checkpoints"),
        ({"base_model": True, "dataset": "not-a-uuid"}, "dataset"),
        ({"base_model": True, "dataset": str(make_dataset(other_project, name="x").id)}, "dataset"),
    ]
    for body, field in cases:
        response = api.post(url, body, format="json")
        if field is None:
            assert "Name at least one model" in api_error(response, 409)["message"]
        else:
            assert field in api_error(response, 400)["fields"], body
    api_error(api.post(url, "[1]", content_type="application/json"), 400)
    api_error(api.post(url, "{not json", content_type="application/json"), 400)
    assert not Eval.objects.exists()


def test_held_out_split_of_a_run_without_held_out_rows_is_409(
    api, project, make_run, world, api_error
):
    run = make_run(project, name="no-holdout", dataset=world.dataset)
    error = api_error(
        api.post(evals_url(run), {"base_model": True, "split": "held_out"}, format="json"), 409
    )
    assert "eval_fraction" in error["message"]


def test_online_run_without_reward_cannot_be_evaluated(api, project, make_run, api_error):
    run = make_run(project, name="online")
    assert (
        "reward"
        in api_error(api.post(evals_url(run), {"base_model": True}, format="json"), 409)["message"]
    )


def test_unknown_ids_and_another_projects_evals_are_404(api, other_api, world, api_error):
    evaluation = Eval.objects.create(
        project=world.run.project, run=world.run, dataset=world.dataset, k=1,
        pass_threshold=1.0, max_new_tokens=4, temperature=1.0,
    )  # fmt: skip
    for tail in ("", f"{evaluation.id}/", f"{evaluation.id}/examples/"):
        api_error(other_api.get(evals_url(world.run, tail)), 404)
        assert api.get(evals_url(world.run, tail)).status_code == 200
    api_error(other_api.post(evals_url(world.run), {"base_model": True}, format="json"), 404)
    for bad in ("nope", str(uuid.uuid4())):
        api_error(api.get(evals_url(world.run, f"{bad}/")), 404)
        api_error(api.get(evals_url(world.run, f"{bad}/examples/")), 404)
    # An eval is found only under its own run.
    api_error(api.get(f"/api/v1/runs/{world.other_run.id}/evals/{evaluation.id}/"), 404)
    api_error(api.get(evals_url(world.run, f"{evaluation.id}/examples/?order=random")), 400)


def test_expired_key_is_401(project, world, api_error):
    from rest_framework.test import APIClient

    _, expired = api_key_create(
        project=project, name="old", expires_at=timezone.now() - timedelta(seconds=1)
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {expired}")
    api_error(client.get(evals_url(world.run)), 401)
    api_error(client.post(evals_url(world.run), {"base_model": True}, format="json"), 401)


def test_an_eval_whose_worker_was_killed_is_queued_again_then_failed(
    world, settings, django_capture_on_commit_callbacks
):
    # A worker killed mid-eval leaves it running with no heartbeat: the reconciler queues it
    # again, until it has been started EVAL_MAX_ATTEMPTS times; a live one is left alone.
    from webapp.evals.services import eval_reconcile
    from webapp.runs.models import RunEvent

    settings.EVAL_HEARTBEAT_S, settings.EVAL_MAX_ATTEMPTS = 15, 2
    now = timezone.now()

    def running(attempts: int, silent_s: float) -> Eval:
        return Eval.objects.create(
            project=world.run.project, run=world.run, dataset=world.dataset, k=1,
            pass_threshold=0.5, max_new_tokens=4, temperature=1.0, status=Eval.Status.RUNNING,
            attempts=attempts, progress_done=3, progress_total=4,
            heartbeat_at=now - timedelta(seconds=silent_s),
        )  # fmt: skip

    stopped, live, spent = running(1, 61), running(1, 59), running(2, 600)
    with django_capture_on_commit_callbacks(execute=False) as queued:
        assert eval_reconcile() == {"requeued": 1, "failed": 1}
    assert len(queued) == 1  # the task is sent once the change is committed
    for evaluation in (stopped, live, spent):
        evaluation.refresh_from_db()
    assert (stopped.status, stopped.progress_done, stopped.heartbeat_at) == ("queued", 0, None)
    assert live.status == "running"
    assert spent.status == "failed" and "stopped 2 times" in spent.error
    assert RunEvent.objects.filter(
        run=world.run, message__contains="queued again (start 2 of 2)"
    ).exists()
    with django_capture_on_commit_callbacks(execute=False) as queued:
        assert eval_reconcile() == {"requeued": 0, "failed": 0}  # nothing more to do
    assert queued == []
