"""A run whose trainer the cluster has no room for waits queued, saying why, and the
reconciler launches it once the room is there (webapp.runs.queueing, issue 17 item 4)."""

from __future__ import annotations

import socket

import pytest
from django.urls import reverse

from webapp.pools.models import Pool
from webapp.runs.launching import run_launch, runs_reconcile
from webapp.runs.models import ClusterReport, Run, RunEvent
from webapp.runs.services import run_queue, run_stop

S = Run.Status
LORA = {"lora_rank": 8, "inference_pool": "shared"}
WAITING = "waiting for 1 GPU for the trainer: 0 of 1 free; pool shared holds 1"


@pytest.fixture
def one_gpu(db):
    """A cluster of one GPU, as a run's job last reported it."""
    return ClusterReport.objects.create(gpus=1, cpus=16)


@pytest.fixture
def no_ray(settings):
    """A Ray address where nothing listens: a launch that gets as far as Ray fails there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        settings.RAY_ADDRESS = f"http://127.0.0.1:{sock.getsockname()[1]}"


def running_pool(make_pool, name="shared"):
    pool = make_pool(name=name)
    Pool.objects.filter(pk=pool.pk).update(status=Pool.Status.RUNNING)
    return pool


def queued(run):
    return run_queue(run=run, message="Start requested.")


def test_a_run_on_a_pool_holding_the_only_gpu_waits_queued_saying_why(
    project, make_run, make_pool, one_gpu, no_ray, api, member_client
):
    running_pool(make_pool)
    run = queued(make_run(project, **LORA))

    assert run_launch(run_id=str(run.id)) == "queued"

    run.refresh_from_db()
    assert (run.status, run.queue_reason, run.job_id) == (S.QUEUED, WAITING, "")
    assert RunEvent.objects.filter(run=run).latest("id").message == WAITING
    body = api.get(f"/api/v1/runs/{run.id}/").json()
    assert (body["status"], body["queue_reason"]) == ("queued", WAITING)
    page = member_client.get(reverse("dashboard:run", args=[project.id, run.id]))
    assert f"Queued: {WAITING}." in page.content.decode()


def test_asking_again_with_the_same_reason_adds_no_history_line(
    project, make_run, make_pool, one_gpu
):
    running_pool(make_pool)
    run = queued(make_run(project, **LORA))
    run_launch(run_id=str(run.id))
    lines = RunEvent.objects.filter(run=run).count()
    assert runs_reconcile()["launched"] == 0
    assert RunEvent.objects.filter(run=run).count() == lines


def test_the_reconciler_launches_the_waiting_run_once_the_pool_frees_the_gpu(
    project, make_run, make_pool, one_gpu, no_ray
):
    pool = running_pool(make_pool)
    run = queued(make_run(project, **LORA))
    run_launch(run_id=str(run.id))
    Pool.objects.filter(pk=pool.pk).update(status=Pool.Status.STOPPED)

    assert runs_reconcile()["launched"] == 1

    run.refresh_from_db()
    kinds = list(RunEvent.objects.filter(run=run).values_list("kind", flat=True))
    # It was submitted (starting); no Ray listens here, so the submission itself failed.
    assert kinds[-3:] == ["queued", "status:starting", "status:failed"]
    assert run.queue_reason == ""
    assert "Could not launch the run" in run.error


def test_another_projects_run_is_counted_but_not_named(
    project, other_project, make_run, make_pool, one_gpu, set_status
):
    ClusterReport.objects.update(gpus=2)
    running_pool(make_pool)
    set_status(make_run(other_project, name="their secret run", **LORA), S.RUNNING)
    mine = set_status(make_run(project, name="mine", **LORA), S.RUNNING)
    run = queued(make_run(project, name="next", **LORA))

    run_launch(run_id=str(run.id))

    run.refresh_from_db()
    assert run.queue_reason == (
        "waiting for 1 GPU for the trainer: 0 of 2 free; pool shared holds 1, "
        f"run '{mine.name}' holds 1, other projects' runs hold 1"
    )
    assert "secret" not in run.queue_reason


def test_a_dataset_run_counts_its_trainer_and_its_own_server(
    project, make_run, make_dataset, set_status
):
    ClusterReport.objects.create(gpus=0, cpus=3)
    holder = set_status(make_run(project, name="letters", dataset=make_dataset(project)), S.RUNNING)
    run = queued(make_run(project, name="next", dataset=make_dataset(project, name="d2")))

    assert run_launch(run_id=str(run.id)) == "queued"

    run.refresh_from_db()
    assert run.queue_reason == (
        "waiting for 2 CPUs for the trainer and 1 inference server: 1 of 3 free; "
        f"run '{holder.name}' holds 2"
    )


def test_a_run_that_fits_is_not_kept_waiting(project, make_run, make_pool, one_gpu, no_ray):
    make_pool(name="shared")  # created, not started: it holds nothing
    run = queued(make_run(project, **LORA))
    assert run_launch(run_id=str(run.id)) == "failed"  # submitted, to a Ray that is not there
    assert not RunEvent.objects.filter(run=run, kind="queued").exists()


def test_a_stopped_waiting_run_forgets_its_reason(project, make_run, make_pool, one_gpu):
    running_pool(make_pool)
    run = queued(make_run(project, **LORA))
    run_launch(run_id=str(run.id))
    run = run_stop(run=run)
    assert (run.status, run.queue_reason) == (S.STOPPING, "")
