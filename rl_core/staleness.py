"""Staleness control: how far behind the trained policy a rollout may be.

Two halves keep every trained token at most ``max_staleness`` versions old:
admission (``StalenessController``) stops new rollouts from starting too far
ahead of training, and the training loop, before each step, takes out of the loss
the tokens that still ended up too old (``mask_stale``; a slow rollout overtaken by
faster ones, or the early turns of a long multi-turn episode). A trajectory keeps its
stale tokens as context (loss mask 0) and trains the rest; it is dropped only when no
generated token is fresh enough. Dropping long episodes whole, as the first version did,
biased training toward short episodes. Admission alone cannot give the bound, because
trajectories finish out of order; the filter alone would waste most rollouts when
generation outruns training. ``rl_core.loop`` is the one place that filters (and calls
``on_dropped``).

The web gateway admits with the same rule, as one conditional UPDATE on the run's
counters (``webapp.gateway.admission``), and reads its settings through
``StalenessBudget.from_config``. This module imports neither torch nor Django.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rl_core.config import stored_setting
from rl_core.types import Trajectory


class StalenessBudget(NamedTuple):
    """The settings of the admission rule (see ``StalenessController``)."""

    max_staleness: int
    batch_size: int
    max_concurrent_rollouts: int  # 0: no cap beyond the staleness budget
    max_queued_batches: int  # 0: no cap on finished, untrained trajectories beyond it

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> StalenessBudget:
        """The budget of a stored run config (``RunConfig.to_dict()``).

        A setting the dict lacks (or holds as null) takes ``RunConfig``'s default, so no
        caller repeats a default.
        """
        return cls(*(int(stored_setting(config, name)) for name in cls._fields))


class StalenessController:
    """Thread-safe admission of rollouts under AReaL's staleness rule.

    A new rollout may start only while::

        accepted + running < (max_staleness + version + 1) * batch_size

    where ``accepted`` counts finished rollouts handed to training (ever, not
    just those waiting), ``running`` counts rollouts in flight and ``version``
    is the current policy version (one per training step). Training consumes
    ``batch_size`` trajectories per version, so at most ``max_staleness`` batches
    beyond the one being trained can be in flight or waiting;
    ``max_staleness = 0`` is synchronous RL: a batch is generated, trained, and
    only then does the next one start (Fu et al. 2025, "AReaL: A Large-Scale
    Asynchronous Reinforcement Learning System for Language Reasoning").

    ``max_concurrent_rollouts > 0`` additionally caps ``running``; ``max_queued_batches = k > 0``
    admits only while ``accepted < (version + 1 + k) * batch_size``: at most ``k`` batches of
    finished trajectories wait beside the one in training. Where the trainer is the slower
    side, AReaL's rule alone lets ``max_staleness`` batches pile up finished, and whatever is
    generated behind them is trained ``max_staleness`` versions later, much of it masked.
    ``StalenessController(*StalenessBudget.from_config(config))`` builds one from a stored config.
    """

    def __init__(
        self,
        max_staleness: int,
        batch_size: int,
        max_concurrent_rollouts: int = 0,
        max_queued_batches: int = 0,
        version: int = 0,
    ):
        if min(max_staleness, max_concurrent_rollouts, max_queued_batches) < 0 or batch_size < 1:
            raise ValueError(
                "need batch_size >= 1 and max_staleness, max_concurrent_rollouts and "
                "max_queued_batches >= 0"
            )
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.max_queued_batches = max_queued_batches
        self._lock = threading.Lock()
        self.version = version
        self.accepted = (
            version * batch_size
        )  # a run resumed at `version` has already trained this many
        self.running = 0
        self.rejected = 0
        self.dropped = 0

    def _capacity(self) -> int:
        return free_capacity(
            max_staleness=self.max_staleness,
            version=self.version,
            batch_size=self.batch_size,
            accepted=self.accepted,
            running=self.running,
            max_concurrent_rollouts=self.max_concurrent_rollouts,
            max_queued_batches=self.max_queued_batches,
        )

    def capacity(self) -> int:
        """How many more rollouts could be admitted right now."""
        with self._lock:
            return self._capacity()

    def try_admit(self) -> bool:
        """Start a rollout if the budget allows; a caller refused should retry later (HTTP 429)."""
        with self._lock:
            if self._capacity() <= 0:
                return False
            self.running += 1
            return True

    def on_finish(self, accepted: bool) -> None:
        """A rollout ended: ``accepted`` when its trajectory goes to training, else rejected or aborted."""
        with self._lock:
            if self.running <= 0:
                raise RuntimeError("on_finish called with no rollout running")
            self.running -= 1
            if accepted:
                self.accepted += 1
            else:
                self.rejected += 1

    def on_dropped(self, n: int) -> None:
        """``n`` accepted trajectories were dropped as stale at training time.

        They free their slots: without this, a run that drops more than
        ``max_staleness * batch_size`` trajectories could never fill a batch again.
        """
        with self._lock:
            if not 0 <= n <= self.accepted:
                raise ValueError(f"cannot drop {n} of {self.accepted} accepted trajectories")
            self.accepted -= n
            self.dropped += n

    def on_unrewarded(self, n: int) -> None:
        """``n`` accepted trajectories will never have a reward (a judge's verdict that failed
        its schema, a human reward that never came): they free their slots, not counted as
        stale. Clamped to what is accepted: a report may reach a job resumed since."""
        with self._lock:
            self.accepted -= max(0, min(n, self.accepted))

    def on_resume(self, version: int) -> None:
        """Training resumed from a checkpoint at ``version``: the batches of the versions
        skipped count as accepted (trained), as in ``StalenessController(version=...)``."""
        with self._lock:
            if version > self.version:
                self.accepted += (version - self.version) * self.batch_size
                self.version = version

    def restore(self, *, version: int, accepted: int, dropped: int | None = None) -> None:
        """Resume with the counts the web app keeps (a Ray job after a restart): ``accepted``
        trajectories ready, claimed or trained in the surviving lineage, none running;
        ``dropped``: the run's trajectories dropped as stale so far (else kept as restored)."""
        with self._lock:
            self.version, self.accepted, self.running = version, accepted, 0
            if dropped is not None:
                self.dropped = dropped

    def counters(self) -> dict[str, int]:
        """The running totals a checkpoint keeps (``restore_counters`` takes them back), so a
        resumed run's ``staleness/rejected`` and ``staleness/dropped_total`` go on from there."""
        with self._lock:
            return {"rejected": self.rejected, "dropped": self.dropped}

    def restore_counters(self, counters: dict[str, int]) -> None:
        with self._lock:
            self.rejected = int(counters.get("rejected", self.rejected))
            self.dropped = int(counters.get("dropped", self.dropped))

    def on_version(self, version: int) -> None:
        """The trainer published ``version``; capacity grows by ``batch_size`` per version."""
        with self._lock:
            if version < self.version:
                raise ValueError(f"policy version went backwards: {self.version} -> {version}")
            self.version = version

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "staleness/version": self.version,
                "staleness/accepted": self.accepted,
                "staleness/running": self.running,
                "staleness/rejected": self.rejected,
                "staleness/dropped_total": self.dropped,
                "staleness/capacity": self._capacity(),
            }


def is_fresh(trajectory: Trajectory, train_version: int, max_staleness: int) -> bool:
    """Whether every generated token of ``trajectory`` is at most ``max_staleness`` versions behind.

    ``train_version`` is the version of the weights the step starts from (the
    proximal policy).
    """
    return train_version - trajectory.oldest_version <= max_staleness


def mask_stale(
    trajectory: Trajectory, train_version: int, max_staleness: int
) -> tuple[Trajectory | None, int]:
    """``trajectory`` with its too-old generated tokens out of the loss, and how many were masked.

    A token is too old when ``train_version - version > max_staleness``. It stays in the
    sequence as context (the fresh tokens after it were generated seeing it) with loss
    mask 0, so the bound holds for every token that contributes to the loss. ``None``
    when no generated token is fresh enough: the trajectory is dropped. A fresh
    trajectory is returned as is (the same object). The turns keep their spans and
    rewards (``turn_ends`` is made explicit, since a masked turn no longer shows in
    ``loss_mask``), so later rewards still credit the fresh turns as before.
    """
    if is_fresh(trajectory, train_version, max_staleness):
        return trajectory, 0
    oldest_fresh = train_version - max_staleness
    mask = [
        int(m and v >= oldest_fresh)
        for m, v in zip(trajectory.loss_mask, trajectory.versions, strict=True)
    ]
    masked = trajectory.num_generated - sum(mask)
    if not any(mask):
        return None, masked
    ends = [end for _, end in trajectory.turn_spans()]
    return dataclasses.replace(trajectory, loss_mask=mask, turn_ends=ends), masked


def filter_stale(
    trajectories: Sequence[Trajectory], train_version: int, max_staleness: int
) -> tuple[list[Trajectory], int]:
    """The trajectories after ``mask_stale``, order preserved, and how many were dropped whole."""
    kept = [
        masked
        for masked, _ in (mask_stale(t, train_version, max_staleness) for t in trajectories)
        if masked is not None
    ]
    return kept, len(trajectories) - len(kept)


def free_capacity(
    *,
    max_staleness: int,
    version: int,
    batch_size: int,
    accepted: int,
    running: int,
    max_concurrent_rollouts: int = 0,
    max_queued_batches: int = 0,
) -> int:
    """Rollouts that may still start: ``(max_staleness + version + 1) * batch_size - accepted - running``,
    also capped by ``max_concurrent_rollouts - running`` when that is set (AReaL's admission rule),
    and by ``(version + 1 + max_queued_batches) * batch_size - accepted`` when that is set (at
    most that many batches finished and waiting beside the one in training), never below 0.

    ``StalenessController`` admits while this is positive. The web gateway does not call
    it: it applies the same rule in SQL (``webapp.gateway.admission.admit``), and
    ``tests/gateway/test_admission_rule_agrees.py`` checks that the two agree.
    """
    free = (max_staleness + version + 1) * batch_size - accepted - running
    if max_concurrent_rollouts:
        free = min(free, max_concurrent_rollouts - running)
    if max_queued_batches:
        free = min(free, (version + 1 + max_queued_batches) * batch_size - accepted)
    return max(free, 0)
