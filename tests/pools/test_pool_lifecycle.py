"""A pool's job dying, and Steep stopping and starting cleanly under its pools."""

from __future__ import annotations

import pytest

from webapp.gateway.models import InferenceServer
from webapp.gateway.services import inference_server_register
from webapp.pools.launching import pool_job_died, pools_interrupt, pools_resume
from webapp.pools.models import Pool
from webapp.pools.services import pool_server_register, pool_stop, pool_transition

P = Pool.Status
LORA = {"base_model": "tiny-llama", "lora_rank": 8}


@pytest.fixture
def serving(make_pool, project, make_run, set_status):
    """A running pool with one server, and a running run routed to it."""
    pool = pool_transition(pool=make_pool(name="shared"), to=P.STARTING)
    Pool.objects.filter(pk=pool.pk).update(job_id="steep-pool-shared-1")
    pool_server_register(pool=pool, url="http://127.0.0.1:9", backend="torch")
    run = set_status(make_run(project, **LORA, inference_pool="shared"), "running")
    inference_server_register(run=run, url="http://127.0.0.1:9", backend="torch")
    pool.refresh_from_db()
    return pool, run


def test_a_serving_pool_whose_job_died_is_launched_again(
    serving, monkeypatch, django_capture_on_commit_callbacks
):
    from webapp.pools import tasks

    pool, run = serving
    queued = []
    monkeypatch.setattr(tasks.pool_launch, "delay", queued.append)
    with django_capture_on_commit_callbacks(execute=True):
        assert pool_job_died(pool=pool, state="FAILED") == "relaunched"
    pool.refresh_from_db()
    assert (pool.status, pool.job_id) == (P.STARTING, "")
    assert "ended unexpectedly (FAILED)" in pool.error
    assert queued == [str(pool.pk)]
    # Its dead server is nobody's any more.
    assert not pool.servers.exists() and not InferenceServer.objects.filter(run=run).exists()


def test_a_pass_that_read_the_pool_before_it_was_relaunched_leaves_it_alone(
    serving, monkeypatch, django_capture_on_commit_callbacks
):
    from webapp.pools import tasks

    pool, _ = serving
    stale = Pool.objects.get(pk=pool.pk)  # a second reconcile pass's read of the dead job
    monkeypatch.setattr(tasks.pool_launch, "delay", lambda pk: None)
    with django_capture_on_commit_callbacks(execute=True):
        assert pool_job_died(pool=pool, state="MISSING") == "relaunched"
    assert pool_job_died(pool=stale, state="MISSING") == "skipped"
    pool.refresh_from_db()
    assert pool.status == P.STARTING  # relaunching, not failed


def test_a_pool_relaunched_between_a_passs_read_and_its_move_is_left_alone(serving, monkeypatch):
    from webapp.pools import tasks

    pool, _ = serving
    monkeypatch.setattr(tasks.pool_launch, "delay", lambda pk: None)
    refresh = Pool.refresh_from_db

    def another_pass_relaunches_it_meanwhile(self, *args, **kwargs):
        refresh(self, *args, **kwargs)  # this pass sees the dead job ...
        Pool.objects.filter(pk=self.pk).update(job_id="steep-pool-shared-2")  # ... then not

    monkeypatch.setattr(Pool, "refresh_from_db", another_pass_relaunches_it_meanwhile)
    assert pool_job_died(pool=pool, state="MISSING") == "skipped"
    monkeypatch.setattr(Pool, "refresh_from_db", refresh)
    pool.refresh_from_db()
    assert (pool.status, pool.job_id) == (P.RUNNING, "steep-pool-shared-2")


def test_a_pool_transition_guarded_by_status_and_job_refuses_a_pool_that_moved_on(serving):
    from webapp.pools.services import IllegalPoolTransition

    pool, _ = serving
    with pytest.raises(IllegalPoolTransition):
        pool_transition(pool=pool, to=P.FAILED, only_from=(P.STARTING,))
    with pytest.raises(IllegalPoolTransition):
        pool_transition(pool=pool, to=P.FAILED, job_id="steep-pool-shared-0")
    pool = pool_transition(
        pool=pool, to=P.FAILED, only_from=(P.RUNNING,), job_id="steep-pool-shared-1"
    )
    assert pool.status == P.FAILED


def test_a_pool_whose_job_died_before_serving_fails_with_the_reason(make_pool):
    pool = pool_transition(pool=make_pool(name="shared"), to=P.STARTING)
    assert pool_job_died(pool=pool, state="FAILED") == "failed"
    pool.refresh_from_db()
    assert pool.status == P.FAILED and "FAILED" in pool.error


def test_a_clean_stop_interrupts_pools_and_a_worker_start_resumes_them(
    serving, make_pool, monkeypatch, django_capture_on_commit_callbacks
):
    from webapp.pools import tasks

    pool, run = serving
    idle = make_pool(name="idle")  # stopped: left alone
    stopping = pool_transition(pool=make_pool(name="going"), to=P.STARTING)
    Pool.objects.filter(pk=stopping.pk).update(job_id="job")
    pool_stop(pool=Pool.objects.get(pk=stopping.pk))
    assert pools_interrupt() == ["shared"]
    statuses = dict(Pool.objects.values_list("name", "status"))
    assert statuses == {"shared": P.INTERRUPTED, "idle": P.STOPPED, "going": P.STOPPED}
    assert not InferenceServer.objects.filter(run=run).exists()
    queued = []
    monkeypatch.setattr(tasks.pool_launch, "delay", queued.append)
    with django_capture_on_commit_callbacks(execute=True):
        assert pools_resume() == ["shared"]
    assert queued == [str(pool.pk)]
    assert Pool.objects.get(pk=idle.pk).status == P.STOPPED


def test_the_interrupt_command_interrupts_pools_too(serving):
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("interrupt_runs", stdout=out)
    assert "1 inference pool(s) interrupted" in out.getvalue()
    assert Pool.objects.get(name="shared").status == P.INTERRUPTED
