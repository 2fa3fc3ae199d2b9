"""Evaluation arithmetic: the held-out split, pass@k, and confidence intervals. Pure Python.

Shared by the web app (which must not import torch), the Ray job (which trains on the other
rows) and ``rl_core.evaluate`` (which generates and scores).

* **Held-out split.** Row ``i`` of a dataset is held out when a hash of ``(seed, i)`` falls
  below ``fraction``: the same rows on every machine and every restart, independent of row
  order elsewhere, and about ``fraction`` of them (at least one when ``fraction > 0``).
* **pass@k** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
  with ``n`` samples of which ``c`` pass, ``1 - C(n - c, k) / C(n, k)``: the chance that at
  least one of ``k`` samples drawn from the ``n`` passes. A sample passes when its reward is
  at least the pass threshold.
* **Confidence intervals**: the percentile bootstrap over examples (Efron & Tibshirani 1993,
  ch. 13): resample the examples with replacement ``BOOTSTRAP_RESAMPLES`` times, take the
  statistic's mean each time, and report the 2.5th and 97.5th percentiles. Seeded, so one
  set of results always gives the same interval. Examples, not samples, are resampled: the
  samples of one prompt are not independent.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BOOTSTRAP_RESAMPLES = 1000
CONFIDENCE = 0.95


def is_held_out(index: int, fraction: float, seed: int = 0) -> bool:
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def split_rows(
    rows: Sequence[dict[str, Any]], fraction: float, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, held_out)``. With ``fraction > 0`` at least one row is held out and at
    least one trains (a tiny dataset would otherwise lose either)."""
    held = [i for i in range(len(rows)) if is_held_out(i, fraction, seed)]
    if fraction > 0 and not held and len(rows) > 1:
        held = [len(rows) - 1]
    if len(held) == len(rows) and len(rows) > 1:
        held = held[1:]
    chosen = set(held)
    train = [row for i, row in enumerate(rows) if i not in chosen]
    return train, [rows[i] for i in held]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` passed (``k <= n``)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def bootstrap_ci(
    values: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """The percentile-bootstrap interval of the mean of ``values``."""
    if not values:
        raise ValueError("a confidence interval needs at least one value")
    if len(values) == 1:
        return float(values[0]), float(values[0])
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = means[max(0, math.floor(tail * resamples))]
    high = means[min(resamples - 1, math.ceil((1 - tail) * resamples) - 1)]
    return float(low), float(high)


@dataclass(frozen=True)
class EvalSummary:
    examples: int
    samples: int
    k: int
    mean_reward: float
    mean_reward_ci: tuple[float, float]
    pass_at_k: float
    pass_at_k_ci: tuple[float, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "samples": self.samples,
            "k": self.k,
            "mean_reward": self.mean_reward,
            "mean_reward_ci": list(self.mean_reward_ci),
            "pass_at_k": self.pass_at_k,
            "pass_at_k_ci": list(self.pass_at_k_ci),
        }


def example_scores(rewards: Sequence[float], k: int, threshold: float) -> tuple[float, float]:
    """One example's ``(mean reward, pass@k)`` from its samples' rewards."""
    n = len(rewards)
    passed = sum(r >= threshold for r in rewards)
    return sum(rewards) / n, pass_at_k(n, passed, min(k, n))


def summarize(per_example: Sequence[Sequence[float]], k: int, threshold: float) -> EvalSummary:
    """Mean reward and pass@k over examples (each the mean of its own), with 95% intervals."""
    if not per_example or any(not rewards for rewards in per_example):
        raise ValueError("every evaluated example needs at least one sample")
    scores = [example_scores(rewards, k, threshold) for rewards in per_example]
    means = [m for m, _ in scores]
    passes = [p for _, p in scores]
    return EvalSummary(
        examples=len(per_example),
        samples=sum(len(r) for r in per_example),
        k=k,
        mean_reward=sum(means) / len(means),
        mean_reward_ci=bootstrap_ci(means),
        pass_at_k=sum(passes) / len(passes),
        pass_at_k_ci=bootstrap_ci(passes),
    )
