"""run_transition is the one place a run's status changes: legal moves succeed, the rest raise."""

from __future__ import annotations

import itertools

import pytest

from webapp.runs.models import Run, RunEvent
from webapp.runs.services import (
    TRANSITIONS,
    IllegalTransition,
    run_delete,
    run_stop,
    run_transition,
)

pytestmark = pytest.mark.django_db

S = Run.Status
PAIRS = list(itertools.product(S.values, S.values))


def test_transitions_cover_every_status():
    assert set(TRANSITIONS) == set(S.values)
    assert all(targets <= set(S.values) for targets in TRANSITIONS.values())
    assert TRANSITIONS[S.COMPLETED] == set()


@pytest.mark.parametrize("current,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_transition(project, make_run, set_status, current, target):
    run = set_status(make_run(project), current)
    events_before = RunEvent.objects.filter(run=run).count()
    if target in TRANSITIONS[current]:
        moved = run_transition(run=run, to=target, message="because")
        assert moved.status == target
        assert Run.objects.get(pk=run.pk).status == target
        event = RunEvent.objects.filter(run=run).latest("id")
        assert (event.kind, event.message) == (f"status:{target}", "because")
    else:
        with pytest.raises(IllegalTransition) as raised:
            run_transition(run=run, to=target)
        assert (raised.value.current, raised.value.target) == (current, target)
        assert current in str(raised.value) and target in str(raised.value)
        assert Run.objects.get(pk=run.pk).status == current
        assert RunEvent.objects.filter(run=run).count() == events_before


def test_transition_reads_the_current_status_from_the_database(project, make_run, set_status):
    run = make_run(project)
    stale = Run.objects.get(pk=run.pk)  # still thinks it is a draft
    set_status(run, S.COMPLETED)
    with pytest.raises(IllegalTransition):
        run_transition(run=stale, to=S.QUEUED)
    assert Run.objects.get(pk=run.pk).status == S.COMPLETED


def test_timestamps_follow_the_lifecycle(project, make_run):
    run = make_run(project)
    run = run_transition(run=run, to=S.QUEUED)
    assert run.queued_at and run.started_at is None and run.finished_at is None
    run = run_transition(run=run, to=S.STARTING)
    run = run_transition(run=run, to=S.RUNNING)
    assert run.started_at and run.finished_at is None
    run = run_transition(run=run, to=S.FAILED, error="CUDA out of memory")
    assert run.finished_at and run.error == "CUDA out of memory"
    assert RunEvent.objects.filter(run=run).latest("id").message == "CUDA out of memory"


def test_requeueing_a_failed_run_clears_its_error_and_finish_time(project, make_run, set_status):
    run = make_run(project)
    for status in (S.QUEUED, S.FAILED):
        run = run_transition(run=run, to=status, error="boom" if status == S.FAILED else None)
    run = run_transition(run=run, to=S.QUEUED)
    assert run.status == S.QUEUED and run.error == "" and run.finished_at is None


@pytest.fixture
def eager_tasks(monkeypatch, settings):
    """Run Celery tasks inline when sent: the real task code, no broker, and no Ray cluster.

    (Starting is covered by test_celery_worker.py: its launch talks to Ray.)
    """
    import socket

    from webapp.runs.tasks import run_launch

    monkeypatch.setitem(run_launch.app.conf, "task_always_eager", True)
    with socket.socket() as sock:  # a port where nothing listens: never start a Ray head here
        sock.bind(("127.0.0.1", 0))
        settings.RAY_ADDRESS = f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_stop_hands_the_run_to_a_worker_only_after_commit(
    project, make_run, set_status, eager_tasks, django_capture_on_commit_callbacks
):
    run = set_status(make_run(project), S.QUEUED)
    with django_capture_on_commit_callbacks(execute=True):
        run = run_stop(run=run)
        assert Run.objects.get(pk=run.pk).status == S.STOPPING
    assert Run.objects.get(pk=run.pk).status == S.STOPPED


@pytest.mark.parametrize("status", [S.QUEUED, S.STARTING, S.RUNNING, S.STOPPING])
def test_active_run_cannot_be_deleted(project, make_run, set_status, status):
    run = set_status(make_run(project), status)
    with pytest.raises(IllegalTransition):
        run_delete(run=run)
    assert Run.objects.filter(pk=run.pk).exists()


@pytest.mark.parametrize("status", [S.DRAFT, S.STOPPED, S.COMPLETED, S.FAILED, S.INTERRUPTED])
def test_inactive_run_can_be_deleted(project, make_run, set_status, status):
    run = set_status(make_run(project), status)
    run_delete(run=run)
    assert not Run.objects.filter(pk=run.pk).exists()


def test_a_status_change_is_one_status_line_once_committed_and_a_failure_a_warning(
    project, make_run, set_status, caplog, django_capture_on_commit_callbacks
):
    # What ./steep up's quiet terminal shows of a run (steep.status, webapp.observability).
    run = set_status(make_run(project, name="mine"), S.RUNNING)
    caplog.set_level("INFO", logger="steep.status")
    with django_capture_on_commit_callbacks(execute=True):
        run_transition(run=run, to=S.FAILED, message="Job failed.", error="out of memory")
        assert caplog.records == []  # not before the commit: a rolled-back move never happened
    [record] = caplog.records
    assert (record.name, record.levelname) == ("steep.status", "WARNING")
    assert record.getMessage() == "run 'mine': failed (out of memory)"
