"""The Celery worker killed (SIGKILL, its whole process group) while a run trains, and started
again: the run completes and its ledger is exact.

The worker owns no training state: a run's job lives in Ray and reports to the web app. What
the kill can take with it is the local Ray head the worker started (it runs in the worker's
process group on the embedded default), and so the job; the restarted worker's reconciler then
finds the job gone and restarts the run from its last checkpoint.
"""

from __future__ import annotations

import pytest

from tests.chaos.faults import (
    assert_ledger_exact,
    create_dataset_run,
    start_and_wait_running,
    wait_finished,
    wait_step,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_run_survives_its_worker_killed_and_restarted(chaos, rest):
    run = create_dataset_run(rest, chaos.model_dir, max_steps=6, save_every=2)
    start_and_wait_running(rest, chaos, run["id"])
    wait_step(rest, chaos, run["id"], 3)

    chaos.kill_worker()
    chaos.start_worker()

    final = wait_finished(rest, chaos, run["id"])
    assert final["step"] == 6, final
    ledger = assert_ledger_exact(rest, run["id"], steps=6, batch_size=16)
    assert ledger["trained"] > 0, ledger
