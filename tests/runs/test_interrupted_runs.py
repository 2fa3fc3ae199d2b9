"""A clean stop of Steep interrupts its runs; they resume at the next start without using the
restart budget, which is for crashes (``webapp.runs.launching``)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from webapp.gateway.models import InferenceServer, Session
from webapp.gateway.services import inference_server_register
from webapp.runs.jobs import job_claim_trajectories, job_report_status, job_submit_episodes
from webapp.runs.launching import (
    LAUNCH_TIMEOUT,
    run_job_died,
    runs_interrupt,
    runs_reconcile,
    runs_resume,
)
from webapp.runs.models import Run, RunEvent
from webapp.runs.services import run_start, run_stop

pytestmark = pytest.mark.django_db

S = Run.Status


def episode(reward: float = 1.0) -> dict:
    return {
        "input_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
        "versions": [0, 0],
        "reward": reward,
    }


@pytest.fixture
def no_launch(django_capture_on_commit_callbacks):
    """Queueing a run hands it to a worker once committed: here, to none (no Ray to launch on)."""
    with django_capture_on_commit_callbacks(execute=False):
        yield


@pytest.mark.parametrize("status", [S.QUEUED, S.STARTING, S.RUNNING])
def test_a_clean_stop_interrupts_active_runs(project, make_run, set_status, status):
    run = set_status(make_run(project), status)

    assert runs_interrupt() == [str(run.id)]

    run.refresh_from_db()
    assert run.status == S.INTERRUPTED and run.error == "" and run.crash_restarts == 0
    event = RunEvent.objects.filter(run=run).latest("id")
    assert event.kind == "status:interrupted" and "resumes" in event.message


def test_a_run_that_was_stopping_is_stopped_not_interrupted(project, make_run, set_status):
    run = set_status(make_run(project), S.STOPPING)
    assert runs_interrupt() == []
    run.refresh_from_db()
    assert run.status == S.STOPPED


@pytest.mark.parametrize("status", [S.DRAFT, S.STOPPED, S.COMPLETED, S.FAILED])
def test_a_clean_stop_leaves_inactive_runs_alone(project, make_run, set_status, status):
    run = set_status(make_run(project), status)
    assert runs_interrupt() == []
    run.refresh_from_db()
    assert run.status == status


def test_an_interrupted_run_gives_back_its_claims_and_forgets_its_servers(
    project, make_run, set_status
):
    run = set_status(make_run(project), S.RUNNING)
    job_submit_episodes(run=run, episodes=[episode(), episode()])
    [claimed] = job_claim_trajectories(run=run, limit=1)
    inference_server_register(run=run, url="http://127.0.0.1:1", backend="torch")

    runs_interrupt()

    assert Session.objects.get(pk=claimed["session_id"]).trajectory == "ready"
    assert not InferenceServer.objects.filter(run=run).exists()


def test_an_interrupted_run_resumes_without_using_its_restart_budget(
    project, make_run, set_status, no_launch
):
    run = set_status(make_run(project), S.INTERRUPTED)
    Run.objects.filter(pk=run.pk).update(crash_restarts=2)

    assert runs_resume() == [str(run.id)]

    run.refresh_from_db()
    assert run.status == S.QUEUED and run.crash_restarts == 2
    assert RunEvent.objects.filter(run=run).latest("id").message.startswith("Steep started again")


def test_resuming_leaves_runs_that_were_not_interrupted_alone(
    project, make_run, set_status, no_launch
):
    runs = {status: set_status(make_run(project, name=status), status) for status in S.values}
    runs_resume()
    for status, run in runs.items():
        run.refresh_from_db()
        expected = S.QUEUED if status == S.INTERRUPTED else status
        assert run.status == expected, status


def test_a_crash_uses_the_restart_budget_and_the_last_one_fails_the_run(
    project, make_run, set_status, settings, no_launch
):
    settings.RUN_MAX_RESTARTS = 2
    run = make_run(project)
    outcomes = []
    for _ in range(3):
        set_status(run, S.RUNNING)
        outcomes.append(run_job_died(run=run, state="FAILED", log_tail=lambda: "boom"))
        run.refresh_from_db()
    assert outcomes == ["restarted", "restarted", "failed"]
    assert run.status == S.FAILED and run.crash_restarts == 2
    assert "ended unexpectedly (FAILED)" in run.error and run.job_log_tail == "boom"
    reconciles = RunEvent.objects.filter(run=run, kind="reconcile").values_list(
        "message", flat=True
    )
    assert [m.split("(")[-1] for m in reconciles] == ["restart 1 of 2).", "restart 2 of 2)."]


def test_interrupts_in_between_do_not_use_the_budget(
    project, make_run, set_status, settings, no_launch
):
    settings.RUN_MAX_RESTARTS = 1
    run = set_status(make_run(project), S.RUNNING)
    for _ in range(5):  # five clean stops and starts of Steep
        runs_interrupt()
        runs_resume()
        set_status(run, S.RUNNING)
    run.refresh_from_db()
    assert run.crash_restarts == 0
    assert run_job_died(run=run, state="MISSING") == "restarted"  # the budget is still whole


def test_an_interrupted_run_is_not_a_crash(project, make_run, set_status, no_launch):
    run = set_status(make_run(project), S.INTERRUPTED)
    assert run_job_died(run=run, state="MISSING") == "skipped"
    run.refresh_from_db()
    assert run.status == S.INTERRUPTED and run.crash_restarts == 0


def test_starting_a_run_by_hand_renews_its_restart_budget(
    project, make_run, set_status, settings, no_launch
):
    settings.RUN_MAX_RESTARTS = 1
    run = set_status(make_run(project), S.RUNNING)
    assert run_job_died(run=run, state="FAILED") == "restarted"
    set_status(run, S.RUNNING)
    assert run_job_died(run=run, state="FAILED") == "failed"

    run = run_start(run=Run.objects.get(pk=run.pk))

    assert run.crash_restarts == 0 and Run.objects.get(pk=run.pk).crash_restarts == 0


def test_what_the_dying_job_reports_last_does_not_change_an_interrupted_run(
    project, make_run, set_status
):
    run = set_status(make_run(project), S.INTERRUPTED)
    for status in (S.STOPPED, S.FAILED, S.COMPLETED):
        assert job_report_status(run=run, status=status, error="killed").status == S.INTERRUPTED
    run.refresh_from_db()
    assert run.status == S.INTERRUPTED and run.error == ""


def test_stopping_an_interrupted_run_keeps_it_from_resuming(
    project, make_run, set_status, no_launch
):
    run = set_status(make_run(project), S.INTERRUPTED)
    assert run_stop(run=run).status == S.STOPPED  # directly: it has no job to stop
    assert runs_resume() == []


def test_a_launch_lost_long_ago_is_a_crash_and_one_under_way_is_left_alone(
    project, make_run, set_status, no_launch
):
    # Starting without a job id: a worker is submitting the job (the previous attempt's id
    # is cleared first), or was killed while it did.
    under_way = set_status(make_run(project, name="under way"), S.STARTING)
    lost = set_status(make_run(project, name="lost"), S.STARTING)
    long_ago = timezone.now() - LAUNCH_TIMEOUT - timedelta(seconds=1)
    Run.objects.filter(pk=lost.pk).update(updated_at=long_ago)

    assert runs_reconcile() == {"restarted": 1, "failed": 0, "launched": 0}

    under_way.refresh_from_db()
    lost.refresh_from_db()
    assert under_way.status == S.STARTING
    assert lost.status == S.QUEUED and lost.crash_restarts == 1


def test_a_reconciler_that_read_the_run_before_another_restarted_it_leaves_it_alone(
    project, make_run, set_status, settings, no_launch
):
    settings.RUN_MAX_RESTARTS = 3
    run = set_status(make_run(project), S.RUNNING)
    Run.objects.filter(pk=run.pk).update(job_id="steep-run-old")
    first, stale = Run.objects.get(pk=run.pk), Run.objects.get(pk=run.pk)  # two passes' reads

    assert run_job_died(run=first, state="MISSING") == "restarted"
    assert run_job_died(run=stale, state="MISSING") == "skipped"  # queued: not its job's crash
    Run.objects.filter(pk=run.pk).update(status=S.STARTING, job_id="")  # the new launch begins
    assert run_job_died(run=stale, state="MISSING") == "skipped"
    Run.objects.filter(pk=run.pk).update(status=S.RUNNING, job_id="steep-run-new")
    assert run_job_died(run=stale, state="MISSING") == "skipped"

    run.refresh_from_db()
    assert run.status == S.RUNNING and run.crash_restarts == 1
    assert RunEvent.objects.filter(run=run, kind="status:failed").count() == 1


def test_a_transition_guarded_by_status_and_job_refuses_a_run_that_moved_on(
    project, make_run, set_status
):
    from webapp.runs.services import IllegalTransition, run_transition

    run = set_status(make_run(project), S.QUEUED)  # restarted since the caller looked
    Run.objects.filter(pk=run.pk).update(job_id="steep-run-old")
    with pytest.raises(IllegalTransition):
        run_transition(run=run, to=S.FAILED, only_from=(S.STARTING, S.RUNNING))
    Run.objects.filter(pk=run.pk).update(status=S.RUNNING, job_id="steep-run-new")
    with pytest.raises(IllegalTransition):
        run_transition(run=run, to=S.FAILED, job_id="steep-run-old")
    run = run_transition(run=run, to=S.FAILED, only_from=(S.RUNNING,), job_id="steep-run-new")
    assert run.status == S.FAILED
