"""The trainer SIGKILLed mid-step, mid-checkpoint and mid weight-update, in one dataset run:
each time the reconciler restarts the run from its last complete checkpoint, what was trained
after it is trained again, and the run completes with an exact ledger."""

from __future__ import annotations

import collections
import random

import pytest

from rl_core.toy import TOY_SETTINGS
from tests.chaos.faults import (
    assert_ledger_exact,
    assert_ledger_in_database,
    create_dataset_run,
    wait_finished,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SEED = 16  # picks the steps; the failpoints make sure each kill lands inside its phase
LEAN = {
    **TOY_SETTINGS,
    "batch_size": 8,
    "group_size": 4,
    "max_staleness": 1,
    "max_steps": 8,
    "save_every": 2,
}


def kill_plan(seed: int) -> list[dict]:
    """Three kills, in the order a run meets them (save_every 2, max_steps 8):

    1. mid-step at step 1 or 2: before the first checkpoint, so the run restarts from version 0;
    2. mid-checkpoint at step 4 or 6: the half-written checkpoint is never resumed from;
    3. mid weight-update at a step after that checkpoint.
    """
    rng = random.Random(seed)
    checkpoint = rng.choice([4, 6])
    return [
        {"name": "train_step", "step": rng.choice([1, 2])},
        {"name": "checkpoint.write", "step": checkpoint},
        {"name": "weight_sync.broadcast", "step": rng.randint(checkpoint + 1, 8)},
    ]


def test_the_trainer_killed_three_times_trains_every_trajectory_once(chaos, rest):
    from webapp.gateway.models import Session
    from webapp.runs.models import Run, RunEvent

    plan = kill_plan(SEED)
    chaos.arm(plan)
    # 128 rows: more than the run's groups, restarts included, so no prompt may repeat.
    run = create_dataset_run(rest, chaos.model_dir, rows=128, **LEAN)
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    final = wait_finished(rest, chaos, run["id"], timeout=900)

    assert chaos.armed() == [], "every kill happened"
    stored = Run.objects.get(pk=run["id"])
    assert (stored.crash_restarts, stored.job_attempt) == (3, 4)
    assert (final["step"], final["weight_version"]) == (LEAN["max_steps"], LEAN["max_steps"])
    ledger = assert_ledger_exact(
        rest, run["id"], batch_size=LEAN["batch_size"], steps=LEAN["max_steps"]
    )
    assert_ledger_in_database(run["id"], ledger, steps=LEAN["max_steps"])
    assert ledger["version"] == LEAN["max_steps"]

    # Where each restart went back to: version 0 (no checkpoint yet), then the checkpoint
    # before the one the kill interrupted, then the last one before the weight update.
    restarts = list(
        RunEvent.objects.filter(run_id=run["id"], kind=RunEvent.RESUME)
        .order_by("created_at", "id")
        .values_list("message", "created_at")
    )
    checkpoint_step, update_step = plan[1]["step"], plan[2]["step"]
    last_before_update = (update_step - 1) // LEAN["save_every"] * LEAN["save_every"]
    assert [message.split(".")[0] for message, _ in restarts] == [
        "Restarted from version 0: no checkpoint was saved",
        f"Restarted from checkpoint of step {checkpoint_step - 2} (version {checkpoint_step - 2})",
        f"Restarted from checkpoint of step {last_before_update} (version {last_before_update})",
    ]

    # The servers served what the run said: a session generated after a restart from version c
    # and trained before the next restart point has tokens of versions c and up, and none
    # the lineage had not reached when it trained them.
    points = [0, checkpoint_step - 2, last_before_update, LEAN["max_steps"]]
    times = [created for _, created in restarts] + [None]
    checked = 0
    for r in range(len(restarts)):
        window = Session.objects.filter(
            run_id=run["id"],
            created_at__gt=times[r],
            trajectory="trained",
            trained_version__lte=points[r + 1],
        )
        if times[r + 1] is not None:
            window = window.filter(created_at__lt=times[r + 1])
        for session in window:
            versions = [
                v for turn in session.interactions.all() for v in turn.outputs[0]["versions"]
            ]
            assert points[r] <= min(versions), (r, versions)
            assert max(versions) < session.trained_version, (versions, session.trained_version)
            checked += 1
    assert checked >= LEAN["batch_size"]

    # The metric series has each step once, 1..max_steps.
    steps = rest.get(f"/runs/{run['id']}/metrics/?name=step&page_size=100").json()["results"]
    assert [point["step"] for point in steps] == list(range(1, LEAN["max_steps"] + 1))

    # Prompt order resumed: 128 rows and far fewer groups, so no row was used twice.
    groups = collections.defaultdict(set)
    for metadata in Session.objects.filter(run_id=run["id"]).values_list("metadata", flat=True):
        groups[metadata["row_index"]].add(metadata["group_id"])
    assert groups and all(len(ids) == 1 for ids in groups.values()), {
        row: len(ids) for row, ids in groups.items() if len(ids) > 1
    }


@pytest.mark.timeout(1100)  # the wait below reports the run's events and its job's log
def test_two_trainer_workers_killed_mid_checkpoint_resume_their_sharded_checkpoint(chaos, rest):
    """train_workers=2 (FSDP2): rank 0 killed while the ranks write a sharded checkpoint (each
    its weight files and optimizer shards), then both killed mid-step. Each restart resumes the
    last complete sharded checkpoint on two new workers, and the ledger stays exact."""
    from webapp.runs.models import Run, RunEvent

    settings = {**LEAN, "train_workers": 2}
    chaos.arm([{"name": "checkpoint.write", "step": 4}, {"name": "train_step", "step": 7}])
    run = create_dataset_run(rest, chaos.model_dir, rows=128, **settings)
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    final = wait_finished(rest, chaos, run["id"], timeout=1000)

    assert chaos.armed() == [], "every kill happened"
    assert Run.objects.get(pk=run["id"]).crash_restarts == 2
    assert (final["step"], final["weight_version"]) == (8, 8)
    ledger = assert_ledger_exact(rest, run["id"], batch_size=settings["batch_size"], steps=8)
    assert_ledger_in_database(run["id"], ledger, steps=8)
    restarts = RunEvent.objects.filter(run_id=run["id"], kind=RunEvent.RESUME).order_by(
        "created_at", "id"
    )
    assert [event.message.split(".")[0] for event in restarts] == [
        "Restarted from checkpoint of step 2 (version 2)",
        "Restarted from checkpoint of step 6 (version 6)",
    ]
