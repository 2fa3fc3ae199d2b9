"""Averaging stats over micro-batches and ranks, and timing named phases."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


class StatsAccumulator:
    """Weighted means of float stats (weight = tokens, usually); keys ending in ``_max`` keep the maximum."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._weights: dict[str, float] = defaultdict(float)
        self._maxes: dict[str, float] = {}

    def add(self, stats: dict[str, float], weight: float = 1.0) -> None:
        for key, value in stats.items():
            if key.endswith("_max"):
                self._maxes[key] = max(self._maxes.get(key, value), value)
            else:
                self._sums[key] += value * weight
                self._weights[key] += weight

    def result(self, reduce_across_ranks: bool = False) -> dict[str, float]:
        """The means (and maxima); with ``reduce_across_ranks`` (a collective) over all ranks' stats."""
        sums, weights, maxes = dict(self._sums), dict(self._weights), dict(self._maxes)
        if reduce_across_ranks and dist.is_available() and dist.is_initialized():
            # Objects, not tensors: a rank with an empty shard reports fewer keys.
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (sums, weights, maxes))
            sums, weights, maxes = defaultdict(float), defaultdict(float), {}
            for s, w, m in gathered:
                for k in s:
                    sums[k] += s[k]
                    weights[k] += w[k]
                for k, v in m.items():
                    maxes[k] = max(maxes.get(k, v), v)
        out = {k: sums[k] / weights[k] for k in sorted(sums) if weights[k] > 0}
        out.update(maxes)
        return out


def logprob_gap(
    recomputed: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    versions: torch.Tensor,
    version: int,
) -> tuple[dict[str, float], int]:
    """How far the inference engine's logprobs are from the trainer's on the same weights.

    Over the trained tokens that version ``version`` generated (the weights the trainer holds
    now, so the policies are equal): ``rollout/logprob_gap`` = mean |recomputed - behaviour|
    and ``rollout/logprob_gap_max``; and how many tokens that was (0: no stats). What is left
    is numerics alone (kernels, dtype, summation order): the mismatch rollout correction
    (the decoupled loss's behaviour weight) absorbs. All tensors ``[T]``.
    """
    fresh = mask.bool() & (versions == version)  # [T]
    count = int(fresh.sum())
    if not count:
        return {}, 0
    gap = (recomputed - behaviour)[fresh].abs()  # [count]
    return {
        "rollout/logprob_gap": gap.mean().item(),
        "rollout/logprob_gap_max": gap.max().item(),
    }, count


class PhaseTimer:
    """Wall time of named phases, reported as ``timing/<phase>`` seconds (summed if a phase repeats)."""

    def __init__(self, sync_cuda: bool = False) -> None:
        self.sync_cuda = sync_cuda
        self.times: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if (
            self.sync_cuda
        ):  # CUDA work is asynchronous: without a sync the time lands in a later phase
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync_cuda:
                torch.cuda.synchronize()
            self.times[name] += time.perf_counter() - start

    def stats(self) -> dict[str, float]:
        return {f"timing/{name}": seconds for name, seconds in self.times.items()}
