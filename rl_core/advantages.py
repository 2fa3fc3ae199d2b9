"""Advantage estimators: pure functions of the batch's rewards.

Every estimator is ``A_i = (R_i - baseline_i) / scale_i``:

- ``grpo``: baseline = mean of the group, scale = std of the group + eps
  (Shao et al. 2024, "DeepSeekMath", §4.1; sample std, as TRL's GRPOTrainer).
- ``rloo``: baseline = mean of the *other* members of the group, scale = 1
  (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization").
- ``reinforce_pp``: baseline = batch mean, scale = batch std + eps
  (Hu 2025, "REINFORCE++": global batch normalisation).

A group of one under grpo or rloo falls back to the batch-level baseline: its
own mean is its own reward, so its advantage would be exactly zero and the
trajectory would silently train nothing. Online sessions have no group
(``group_id == ""``), so each is such a group of one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from rl_core.types import Trajectory

logger = logging.getLogger(__name__)

METHODS = ("grpo", "rloo", "reinforce_pp")
_ZERO = 1e-8  # |A| below this trains nothing


def _groups(group_ids: Sequence[str]) -> list[list[int]]:
    """Indices of each group in first-seen order; every "" is its own group of one."""
    by_id: dict[str, list[int]] = {}
    groups: list[list[int]] = []
    for i, g in enumerate(group_ids):
        if g == "":
            groups.append([i])
        elif g in by_id:
            by_id[g].append(i)
        else:
            by_id[g] = [i]
            groups.append(by_id[g])
    return groups


def _std(x: torch.Tensor) -> torch.Tensor:
    return x.std() if x.numel() > 1 else x.new_zeros(())


def baseline_and_scale(
    rewards: torch.Tensor, group_ids: Sequence[str], method: str, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(baseline [N], scale [N], singleton_count)`` so that ``A = (R - baseline) / scale``."""
    if method not in METHODS:
        raise ValueError(
            f"unknown advantage method {method!r}; use one of {', '.join(METHODS)} ('auto' is resolved by RunConfig.resolved_advantage)"
        )
    # float64: a group of equal rewards must get exactly zero advantage; in float32 the
    # mean's rounding error, divided by std + eps, became a sizeable push (e.g. -0.056).
    r = torch.as_tensor(rewards, dtype=torch.float64)  # [N]
    n = r.numel()
    if len(group_ids) != n:
        raise ValueError(f"got {n} rewards but {len(group_ids)} group ids")
    batch_mean, batch_std = r.mean(), _std(r)
    # Leave-one-out mean over the batch; a batch of one has no "others" and keeps its own reward.
    batch_loo = (r.sum() - r) / (n - 1) if n > 1 else r.clone()  # [N]
    baseline = torch.empty_like(r)
    scale = torch.ones_like(r)
    singletons = 0
    if method == "reinforce_pp":
        baseline[:] = batch_mean
        scale[:] = batch_std + eps
        return baseline, scale, 0
    for idx in _groups(group_ids):
        ix = torch.tensor(idx)
        if len(idx) == 1:
            singletons += 1
            baseline[ix] = batch_mean if method == "grpo" else batch_loo[ix]
            scale[ix] = batch_std + eps if method == "grpo" else 1.0
            continue
        g = r[ix]  # [G]
        if method == "grpo":
            baseline[ix] = g.mean()
            scale[ix] = g.std() + eps
        else:
            baseline[ix] = (g.sum() - g) / (len(idx) - 1)
    return baseline, scale, singletons


def grpo(rewards: torch.Tensor, group_ids: Sequence[str], eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``(R - mean_g) / (std_g + eps)``  # [N]"""
    b, s, _ = baseline_and_scale(rewards, group_ids, "grpo", eps)
    return ((torch.as_tensor(rewards, dtype=torch.float64) - b) / s).float()


def rloo(rewards: torch.Tensor, group_ids: Sequence[str]) -> torch.Tensor:
    """Leave-one-out advantages ``R_i - mean_{j != i in g} R_j``  # [N]"""
    b, s, _ = baseline_and_scale(rewards, group_ids, "rloo")
    return ((torch.as_tensor(rewards, dtype=torch.float64) - b) / s).float()


def reinforce_pp(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Batch-normalised advantages ``(R - mean) / (std + eps)``  # [N]"""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    b, s, _ = baseline_and_scale(r, [""] * r.numel(), "reinforce_pp", eps)
    return ((r - b) / s).float()


def _advantage_stats(
    adv: torch.Tensor, singletons: int, all_zero: bool, warn: bool = True
) -> dict[str, float]:
    """Stats of episode-level advantages ``adv [N]``; warns when nothing would be trained."""
    if all_zero and warn:
        logger.warning(
            "All advantages are zero: every group's rewards are identical, so this step trains nothing. "
            "Check that the reward function separates good answers from bad ones, or raise group_size."
        )
    n = adv.numel()
    return {
        "advantages/mean": adv.mean().item() if n else 0.0,
        "advantages/std": _std(adv).item(),
        "advantages/abs_max": adv.abs().max().item() if n else 0.0,
        "advantages/zero_frac": (adv.abs() < _ZERO).float().mean().item() if n else 1.0,
        "advantages/all_zero": float(all_zero),
        "advantages/singleton_frac": singletons / n if n else 0.0,
    }


def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[str],
    method: str,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One advantage per trajectory: ``(advantages [N], stats)``; ``method`` in grpo, rloo, reinforce_pp."""
    r = torch.as_tensor(rewards, dtype=torch.float64)  # [N]
    b, s, singletons = baseline_and_scale(r, group_ids, method, eps)
    adv = ((r - b) / s).float()  # [N]
    return adv, _advantage_stats(adv, singletons, bool((adv.abs() < _ZERO).all()))


def token_advantages(
    trajectories: Sequence[Trajectory], method: str, turn_discount: float = 1.0, eps: float = 1e-6
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per-token advantages for (multi-turn) trajectories: ``([L_i] per trajectory, stats)``.

    The baseline and scale come from the episodes' scalar rewards ``R_i`` (the
    discounted return from the first turn). A token of turn ``k`` gets
    ``(G_k - baseline_i) / scale_i`` with ``G_k = sum_{j >= k} turn_discount^(j-k) r_j``,
    so a reward also credits the turns that led to it. Only assistant tokens
    (``loss_mask == 1``) get a nonzero advantage; single-turn episodes reduce to
    the per-trajectory estimators above.
    """
    r = torch.tensor([t.reward(turn_discount) for t in trajectories], dtype=torch.float64)  # [N]
    b, s, singletons = baseline_and_scale(r, [t.group_id for t in trajectories], method, eps)
    out, flat = [], []
    for i, traj in enumerate(trajectories):
        adv = torch.zeros(len(traj.input_ids))  # [L]
        for (start, end), g in zip(traj.turn_spans(), traj.returns(turn_discount), strict=True):
            adv[start:end] = float((g - b[i]) / s[i])
        adv *= torch.tensor(traj.loss_mask, dtype=torch.float32)
        out.append(adv)
        flat.append((r[i] - b[i]) / s[i])
    # Judged per token: later turns can carry signal even when episode-level advantages are zero.
    all_zero = all(bool((a.abs() < _ZERO).all()) for a in out)
    # A teacher's per-token signal (rl_core.distill) trains a batch whose rewards are all equal.
    distilled = any(t.teacher_logprobs is not None for t in trajectories)
    return out, _advantage_stats(
        torch.stack(flat) if flat else torch.zeros(0), singletons, all_zero, warn=not distilled
    )
