"""The trainer's claim on ready trajectories: concurrent claimers never share a session."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from webapp.gateway.models import Session
from webapp.gateway.services import trajectories_claim

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def run_and_agent(project, make_run, make_agent):
    run = make_run(project, base_model="tiny-model")
    return run, make_agent(project, run=run)


def _sessions(
    run, agent, count: int, *, trajectory: str = "ready", start: int = 0
) -> list[Session]:
    now = timezone.now()
    return [
        Session.objects.create(
            project_id=agent.project_id,
            agent=agent,
            run=run,
            status="ended",
            trajectory=trajectory,
            ended_at=now - timedelta(seconds=1000 - start - i),
        )
        for i in range(count)
    ]


def test_two_concurrent_claimers_never_get_the_same_session(run_and_agent):
    run, agent = run_and_agent
    ready = {s.pk for s in _sessions(run, agent, 60)}
    barrier, first_batches = threading.Barrier(2), threading.Barrier(2)
    claimed: list[list] = [[], []]
    errors: list[BaseException] = []

    def claimer(index: int) -> None:
        try:
            barrier.wait(timeout=10)
            while batch := trajectories_claim(run=run, limit=3):
                if not claimed[index]:
                    # Both take part whatever the scheduler does: each waits for the other's
                    # first batch before claiming more.
                    first_batches.wait(timeout=10)
                claimed[index] += [s.pk for s in batch]
                time.sleep(0.01)  # let the other claimer in between batches
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()  # this thread's own connection

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert not errors, errors
    first, second = set(claimed[0]), set(claimed[1])
    assert len(first) == len(claimed[0]) and len(second) == len(claimed[1])
    assert not first & second
    assert first | second == ready
    assert first and second  # both took part
    assert set(Session.objects.values_list("trajectory", flat=True)) == {"claimed"}
    assert not Session.objects.filter(claimed_at__isnull=True).exists()


def test_claim_takes_ready_sessions_of_its_run_oldest_first(run_and_agent, project, make_run):
    run, agent = run_and_agent
    oldest = _sessions(run, agent, 3)
    _sessions(run, agent, 2, trajectory="unrewarded")
    _sessions(run, agent, 2, trajectory="trained")
    other_run = make_run(project, name="other", base_model="tiny-model")
    _sessions(other_run, agent, 2)
    newest = _sessions(run, agent, 2, start=500)

    first = trajectories_claim(run=run, limit=3)
    assert [s.pk for s in first] == [s.pk for s in oldest]
    assert all(s.trajectory == "claimed" for s in first)
    assert [s.pk for s in trajectories_claim(run=run, limit=10)] == [s.pk for s in newest]
    assert trajectories_claim(run=run, limit=10) == []
    assert Session.objects.filter(run=other_run, trajectory="ready").count() == 2


@pytest.mark.parametrize("status", ["completed", "failed", "stopped", "interrupted"])
def test_a_run_that_has_ended_gives_no_claims_and_its_sessions_stay_ready(run_and_agent, status):
    # A trainer's long-poll claim still waiting when the run ends must not take a session
    # ended after the run's end released its claims: it would stay claimed for good.
    run, agent = run_and_agent
    ready = _sessions(run, agent, 2)
    type(run).objects.filter(pk=run.pk).update(status=status)

    assert trajectories_claim(run=run, limit=10) == []
    assert {s.trajectory for s in Session.objects.filter(pk__in=[s.pk for s in ready])} == {"ready"}


def test_a_stopping_run_still_claims_for_the_step_it_finishes(run_and_agent):
    run, agent = run_and_agent
    ready = _sessions(run, agent, 2)
    type(run).objects.filter(pk=run.pk).update(status="stopping")

    assert [s.pk for s in trajectories_claim(run=run, limit=10)] == [s.pk for s in ready]
