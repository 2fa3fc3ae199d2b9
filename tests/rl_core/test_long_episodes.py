"""Long multi-turn episodes outlive the staleness bound: their stale turns become context
(loss mask 0), their fresh turns are trained, and only an episode with nothing fresh is dropped."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.config import RunConfig
from rl_core.loop import ListReporter, QueueSource, TrainingLoop
from rl_core.packing import pack, packed_logprobs
from rl_core.staleness import mask_stale
from rl_core.trainer import PPOTrainer
from rl_core.types import Trajectory

PROMPT, REPLY = 3, 4  # tokens per user message and per assistant answer


def _episode(turn_versions: list[int], rewards: list[float] | None = None) -> Trajectory:
    """One sequence: per turn, a user message (untrained) then an answer generated at its version."""
    rng = random.Random(len(turn_versions))
    ids, mask, versions, ends = [], [], [], []
    for version in turn_versions:
        ids += [rng.randrange(256) for _ in range(PROMPT + REPLY)]
        mask += [0] * PROMPT + [1] * REPLY
        versions += [-1] * PROMPT + [version] * REPLY
        ends.append(len(ids))
    return Trajectory(
        input_ids=ids,
        loss_mask=mask,
        logprobs=[-1.0 if m else 0.0 for m in mask],
        versions=versions,
        rewards=rewards if rewards is not None else [0.0] * len(turn_versions),
        turn_ends=ends,
    )


def _turn_mask(trajectory: Trajectory) -> list[int]:
    """Per turn: 1 when its answer is trained, 0 when it is context only."""
    return [int(any(trajectory.loss_mask[start:end])) for start, end in trajectory.turn_spans()]


class RecordingTrainer(PPOTrainer):
    """The real trainer, keeping what each step was given."""

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.given: list[list[Trajectory]] = []

    def train_step(self, trajectories):
        self.given.append(list(trajectories))
        return super().train_step(trajectories)


def _on_policy(trainer: PPOTrainer, trajectory: Trajectory) -> Trajectory:
    with torch.no_grad():
        logprobs, _ = packed_logprobs(trainer.model, pack([trajectory]))
    trajectory.logprobs = [
        lp * m for lp, m in zip(logprobs.tolist(), trajectory.loss_mask, strict=True)
    ]
    return trajectory


async def _one_step(trainer: PPOTrainer, trajectories: list[Trajectory]):
    source, reporter = QueueSource(), ListReporter()
    for i, trajectory in enumerate(trajectories):
        await source.put(str(i), trajectory)
    source.close()
    await TrainingLoop(trainer.cfg, trainer, source, None, reporter).run(max_steps=1)
    return source, reporter


async def test_a_six_turn_session_over_three_versions_masks_its_old_turns_and_trains_its_fresh_ones(
    tiny_model_dir,
):
    cfg = RunConfig.from_dict(
        {
            "base_model": str(tiny_model_dir),
            "mode": "online",
            "batch_size": 2,
            "max_staleness": 1,
            "learning_rate": 1e-2,
        }
    )
    trainer = RecordingTrainer(cfg)
    long = _on_policy(trainer, _episode([0, 0, 1, 1, 2, 2], rewards=[0, 0, 0, 0, 0, 1.0]))
    old = _on_policy(trainer, _episode([0, 0]))  # nothing left to train at version 2
    short = _on_policy(trainer, _episode([2]))
    trainer.version = 2  # two steps happened while the episodes ran

    source, reporter = await _one_step(trainer, [long, old, short])

    ((trained_long, trained_short),) = trainer.given
    assert trained_long.input_ids == long.input_ids  # the old turns stay as context
    assert _turn_mask(trained_long) == [0, 0, 1, 1, 1, 1]
    assert trained_long.rewards == long.rewards
    assert trained_short is short
    assert (source.trained, source.dropped) == (2, 1)
    ((_, version, stats),) = reporter.metrics_log
    assert version == 3
    assert stats["staleness/masked_tokens"] == 2 * REPLY + 2 * REPLY  # long's two turns + old's two
    assert stats["staleness/dropped"] == 1.0
    assert stats["staleness/max"] == 1.0  # no trained token is older than the bound


def test_a_fresh_trajectory_is_trained_as_it_is():
    trajectory = _episode([3, 4])
    assert mask_stale(trajectory, train_version=4, max_staleness=1) == (trajectory, 0)


def test_masking_keeps_the_turns_of_a_trajectory_without_turn_ends():
    trajectory = _episode([0, 1, 2])
    trajectory.turn_ends = None  # the turns are read off the loss mask
    masked, count = mask_stale(trajectory, train_version=2, max_staleness=1)
    assert count == REPLY
    assert masked.turn_spans() == trajectory.turn_spans()
    assert _turn_mask(masked) == [0, 1, 1]


def test_a_turn_that_straddles_a_weight_update_keeps_only_its_fresh_tokens():
    trajectory = _episode([1])
    trajectory.versions[-2:] = [2, 2]  # the update landed mid-answer
    masked, count = mask_stale(trajectory, train_version=3, max_staleness=1)
    assert count == REPLY - 2
    assert masked.loss_mask[-REPLY:] == [0, 0, 1, 1]


TURNS = st.lists(
    st.lists(st.integers(0, 8), min_size=1, max_size=4),  # how far behind each answer token is
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(TURNS, st.integers(0, 10), st.integers(0, 4))
def test_every_token_in_the_loss_is_within_the_bound_and_every_fresh_token_is_trained(
    turns, train_version, max_staleness
):
    ids, mask, versions, ends = [], [], [], []
    for lags in turns:
        ids += [7, 7, *[8] * len(lags)]
        mask += [0, 0, *[1] * len(lags)]
        versions += [-1, -1, *(max(train_version - lag, 0) for lag in lags)]
        ends.append(len(ids))
    trajectory = Trajectory(
        ids, mask, [-0.5 * m for m in mask], versions, [1.0] * len(turns), turn_ends=ends
    )
    fresh_tokens = [
        i
        for i, (m, v) in enumerate(zip(mask, versions, strict=True))
        if m and train_version - v <= max_staleness
    ]

    masked, count = mask_stale(trajectory, train_version, max_staleness)

    if not fresh_tokens:
        assert masked is None and count == sum(mask)
        return
    assert masked is not None
    in_loss = [i for i, m in enumerate(masked.loss_mask) if m]
    assert in_loss == fresh_tokens
    assert all(0 <= train_version - masked.versions[i] <= max_staleness for i in in_loss)
    assert count == sum(mask) - len(in_loss)
    assert (masked.input_ids, masked.versions, masked.logprobs) == (
        ids,
        versions,
        trajectory.logprobs,
    )
    assert masked.turn_spans() == trajectory.turn_spans() and masked.rewards == trajectory.rewards
