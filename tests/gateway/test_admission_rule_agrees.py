"""The gateway's SQL admission (``admission.admit``, one conditional UPDATE on the run's
counters) and the in-process ``StalenessController`` apply the same rule: in the same state
they give the same answer, also at the boundary and for configs that leave settings out."""

from __future__ import annotations

import itertools

import pytest
from django.db import connection

from rl_core.staleness import StalenessBudget, StalenessController
from webapp.gateway import admission
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db

# (config as stored, policy version, accepted, running); RunConfig's defaults are
# max_staleness 4, batch_size 8, no concurrency cap: (4 + 0 + 1) * 8 = 40 slots at version 0.
CASES = {
    "defaults-empty-budget": ({}, 0, 0, 0),
    "defaults-last-slot": ({}, 0, 20, 19),
    "defaults-full": ({}, 0, 20, 20),
    "defaults-next-version": ({}, 1, 20, 20),
    "sync-first-of-batch": ({"max_staleness": 0, "batch_size": 4}, 0, 0, 0),
    "sync-last-of-batch": ({"max_staleness": 0, "batch_size": 4}, 0, 3, 0),
    "sync-batch-full": ({"max_staleness": 0, "batch_size": 4}, 0, 4, 0),
    "sync-batch-in-flight": ({"max_staleness": 0, "batch_size": 4}, 0, 1, 3),
    "sync-trained-one-version": ({"max_staleness": 0, "batch_size": 4}, 1, 4, 3),
    "sync-batch-of-one": ({"max_staleness": 0, "batch_size": 1}, 0, 0, 1),
    "over-budget": ({"max_staleness": 1, "batch_size": 2}, 0, 5, 0),
    "cap-below-budget": (
        {"max_staleness": 4, "batch_size": 8, "max_concurrent_rollouts": 3},
        0,
        0,
        2,
    ),
    "cap-reached": ({"max_staleness": 4, "batch_size": 8, "max_concurrent_rollouts": 3}, 0, 0, 3),
    "cap-of-one": ({"max_concurrent_rollouts": 1}, 0, 10, 1),
    "cap-zero-is-no-cap": ({"max_concurrent_rollouts": 0}, 0, 0, 39),
    "cap-null-is-no-cap": ({"max_concurrent_rollouts": None}, 0, 0, 39),
    "cap-above-budget": (
        {"max_staleness": 0, "batch_size": 2, "max_concurrent_rollouts": 5},
        0,
        1,
        1,
    ),
    "queue-cap-room": ({"max_queued_batches": 1}, 0, 15, 4),
    "queue-cap-full": ({"max_queued_batches": 1}, 0, 16, 4),
    "queue-cap-next-version": ({"max_queued_batches": 1}, 1, 16, 4),
    "queue-cap-above-budget": ({"max_staleness": 1, "max_queued_batches": 3}, 0, 8, 7),
    "queue-cap-zero-is-no-cap": ({"max_queued_batches": 0}, 0, 30, 9),
    "late-version": ({"max_staleness": 2, "batch_size": 3}, 7, 29, 0),
    "late-version-full": ({"max_staleness": 2, "batch_size": 3}, 7, 29, 1),
}


@pytest.fixture
def run(project, make_run):
    return make_run(project)


def sql_admits(run, config: dict, version: int, accepted: int, running: int) -> bool:
    Run.objects.filter(pk=run.pk).update(
        status="running",
        config=config,
        weight_version=version,
        sessions_accepted=accepted,
        sessions_open=running,
    )
    run.refresh_from_db()
    with connection.cursor() as cursor:
        admitted = admission.admit(cursor, run_id=run.pk, config=run.config)
    run.refresh_from_db()
    assert run.sessions_open == running + admitted  # the slot is taken exactly when admitted
    return admitted


def controller_admits(config: dict, version: int, accepted: int, running: int) -> bool:
    controller = StalenessController(*StalenessBudget.from_config(config), version=version)
    controller.accepted, controller.running = accepted, running
    admitted = controller.try_admit()
    assert controller.running == running + admitted
    return admitted


@pytest.mark.parametrize(("config", "version", "accepted", "running"), CASES.values(), ids=CASES)
def test_sql_admission_and_the_controller_agree(run, config, version, accepted, running):
    expected = controller_admits(config, version, accepted, running)
    assert sql_admits(run, config, version, accepted, running) == expected


def test_both_fill_exactly_the_budget_around_every_boundary(run):
    for max_staleness, batch_size, cap, queued, version in itertools.product(
        (0, 1, 3), (1, 2, 5), (0, None, 1, 4), (0, 1), (0, 2)
    ):
        config = {
            "max_staleness": max_staleness,
            "batch_size": batch_size,
            "max_concurrent_rollouts": cap,
            "max_queued_batches": queued,
        }
        slots = (max_staleness + version + 1) * batch_size
        queue = (version + 1 + queued) * batch_size  # where the queue cap binds on accepted
        for used in (slots - 2, slots - 1, slots, slots + 1):
            for running in {0, 1, (cap or 1) - 1, cap or 0, used, used - queue, used - queue + 1}:
                accepted = used - running
                if accepted < 0 or running < 0:
                    continue
                state = (config, version, accepted, running)
                assert sql_admits(run, *state) == controller_admits(*state), state


def test_budget_defaults_come_from_run_config():
    from rl_core.config import RunConfig

    default = RunConfig()
    assert admission.budget({}) == (
        default.max_staleness,
        default.batch_size,
        default.max_concurrent_rollouts,
        default.max_queued_batches,
    )
    assert admission.budget({"max_staleness": 0, "batch_size": 3}) == (
        0,
        3,
        default.max_concurrent_rollouts,
        default.max_queued_batches,
    )
