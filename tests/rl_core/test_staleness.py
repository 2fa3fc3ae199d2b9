import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rl_core.staleness import StalenessController, filter_stale
from rl_core.types import Trajectory


def _traj(token_versions: list[int]) -> Trajectory:
    n = len(token_versions)
    return Trajectory(
        input_ids=[0] + [1] * n,
        loss_mask=[0] + [1] * n,
        logprobs=[0.0] * (n + 1),
        versions=[-1, *token_versions],
        rewards=[0.0],
    )


def test_admission_stops_at_the_staleness_budget():
    ctrl = StalenessController(max_staleness=1, batch_size=2)
    # (max_staleness + version + 1) * batch_size = (1 + 0 + 1) * 2 = 4 slots.
    assert [ctrl.try_admit() for _ in range(5)] == [True, True, True, True, False]
    ctrl.on_finish(accepted=False)  # an aborted rollout frees its slot
    assert ctrl.try_admit()
    assert not ctrl.try_admit()
    ctrl.on_version(1)  # one more batch of budget per version
    assert [ctrl.try_admit() for _ in range(3)] == [True, True, False]


def test_accepted_rollouts_keep_their_slot_until_dropped():
    ctrl = StalenessController(max_staleness=0, batch_size=2)
    assert ctrl.try_admit() and ctrl.try_admit()
    ctrl.on_finish(accepted=True)
    ctrl.on_finish(accepted=True)
    assert not ctrl.try_admit()  # finished but not yet trained: still counted
    ctrl.on_dropped(1)
    assert ctrl.try_admit()
    assert ctrl.stats() == {
        "staleness/version": 0,
        "staleness/accepted": 1,
        "staleness/running": 1,
        "staleness/rejected": 0,
        "staleness/dropped_total": 1,
        "staleness/capacity": 0,
    }


def test_max_concurrent_rollouts_caps_running():
    ctrl = StalenessController(max_staleness=10, batch_size=4, max_concurrent_rollouts=3)
    assert [ctrl.try_admit() for _ in range(4)] == [True, True, True, False]
    ctrl.on_finish(accepted=True)
    assert ctrl.try_admit()


def test_max_queued_batches_stops_generation_running_ahead_of_a_slow_trainer():
    ctrl = StalenessController(max_staleness=4, batch_size=4, max_queued_batches=1)
    assert ctrl.capacity() == 8  # AReaL's rule alone: 20 slots; the batch in training + 1 more
    for _ in range(8):
        assert ctrl.try_admit()
        ctrl.on_finish(accepted=True)  # finished at once: the trainer is the slow side
    assert ctrl.capacity() == 0 and not ctrl.try_admit()
    ctrl.on_version(1)  # one batch trained: one more may queue
    assert ctrl.capacity() == 4
    unbounded = StalenessController(max_staleness=4, batch_size=4)
    unbounded.accepted = 8
    assert unbounded.capacity() == 12  # the cap is off by default


def test_resumed_controller_counts_the_trained_batches():
    ctrl = StalenessController(max_staleness=0, batch_size=2, version=5)
    assert ctrl.capacity() == 2


def test_finish_without_running_rollout_is_an_error():
    with pytest.raises(RuntimeError):
        StalenessController(1, 1).on_finish(accepted=True)


def test_version_cannot_go_backwards():
    ctrl = StalenessController(1, 1, version=3)
    with pytest.raises(ValueError):
        ctrl.on_version(2)


def test_concurrent_admissions_never_exceed_capacity():
    ctrl = StalenessController(max_staleness=4, batch_size=4)  # 20 slots
    admitted = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        admitted.append(sum(ctrl.try_admit() for _ in range(100)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted) == 20
    assert ctrl.running == 20


def test_filter_stale_masks_too_old_tokens_and_drops_trajectories_with_nothing_fresh():
    fresh, edge, mixed, stale = _traj([5, 6]), _traj([3, 5]), _traj([2, 5]), _traj([1, 2])
    kept, dropped = filter_stale([fresh, edge, mixed, stale], train_version=5, max_staleness=2)
    assert kept[:2] == [fresh, edge]
    assert kept[2].loss_mask == [0, 0, 1]  # its version-2 token is context now
    assert dropped == 1


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "token", "token", "finish", "train"]),
        st.integers(0, 10**6),
    ),
    min_size=40,
    max_size=300,
)


def _simulate(max_staleness, batch_size, max_concurrent, actions):
    """Rollouts admitted by the controller generate tokens at whatever version is current,
    finish in any order, and a trainer takes any `batch_size` of the finished ones."""
    ctrl = StalenessController(max_staleness, batch_size, max_concurrent)
    version, running, ready, trained, events = 0, [], [], 0, []
    for action, k in actions:
        if action == "admit" and ctrl.try_admit():
            running.append([])
            # The rule itself, checked against the simulation's own counts.
            assert trained + len(ready) + len(running) <= (max_staleness + version + 1) * batch_size
        elif action == "token" and running:
            running[k % len(running)].append(version)
        elif action == "finish" and running:
            tokens = running.pop(k % len(running))
            ctrl.on_finish(accepted=bool(tokens))  # a rollout with no tokens was aborted
            if tokens:
                ready.append(_traj(tokens))
        elif action == "train" and len(ready) >= batch_size:
            start = k % len(ready)
            ready = ready[start:] + ready[:start]
            batch, ready = ready[:batch_size], ready[batch_size:]
            kept, dropped = filter_stale(batch, version, max_staleness)
            ctrl.on_dropped(dropped)
            events.append(
                {"version": version, "kept": kept, "dropped": dropped, "running": len(running)}
            )
            trained += len(kept)
            if kept:
                version += 1
                ctrl.on_version(version)
    return events


# A slow rollout overtaken by two trained batches: admission let it in, only the filter stops it.
SLOW_ROLLOUT = [
    ("admit", 0),
    ("token", 0),
    ("admit", 0),
    ("token", 1),
    ("finish", 1),
    ("train", 0),
    ("admit", 0),
    ("token", 1),
    ("finish", 1),
    ("train", 0),
    ("finish", 0),
    ("train", 0),
]


def test_a_slow_rollout_is_dropped_not_trained():
    events = _simulate(1, 1, 0, SLOW_ROLLOUT)
    assert [(e["version"], len(e["kept"]), e["dropped"]) for e in events] == [
        (0, 1, 0),
        (1, 1, 0),
        (2, 0, 1),
    ]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3), st.integers(1, 4), st.integers(0, 6), ACTIONS)
@example(1, 1, 0, SLOW_ROLLOUT)
def test_no_trained_token_is_more_than_max_staleness_versions_old(
    max_staleness, batch_size, max_concurrent, actions
):
    for event in _simulate(max_staleness, batch_size, max_concurrent, actions):
        for traj in event["kept"]:
            for v, m in zip(traj.versions, traj.loss_mask, strict=True):
                if m:
                    assert 0 <= event["version"] - v <= max_staleness


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), ACTIONS)
def test_zero_staleness_is_synchronous(batch_size, actions):
    events = _simulate(0, batch_size, 0, actions)
    for event in events:
        # Training waits for the whole batch, nothing else is in flight, every token is on-policy.
        assert event["running"] == 0
        assert event["dropped"] == 0
        assert {v for t in event["kept"] for v in t.versions if v >= 0} == {event["version"]}


def test_web_side_modules_do_not_import_torch():
    # The gateway admits rollouts and builds trajectories; the web process must stay torch-free.
    code = "import sys, rl_core.staleness, rl_core.types, rl_core.rewards; print('torch' in sys.modules)"
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_a_restarted_job_takes_the_web_apps_counts_not_a_guess_from_the_version():
    # Resumed at version 2 with 21 trajectories accepted (trained + ready + claimed) in the
    # surviving lineage: more than the 2 * 8 the version alone would suggest.
    controller = StalenessController(max_staleness=1, batch_size=8, version=0)
    assert controller.try_admit()
    controller.restore(version=2, accepted=21)
    assert (controller.version, controller.accepted, controller.running) == (2, 21, 0)
    assert controller.capacity() == (1 + 2 + 1) * 8 - 21
