"""Multi-agent runs (``RunConfig.roles``): what the trainer does per role.

A run with roles trains one LoRA adapter per role on its one base model (``rl_core.lora``).
``PPOTrainer.train_step`` splits its batch by ``Trajectory.role`` (``split_by_role``) and
updates each role in turn with that role's adapter active: the role's advantages and
baselines are computed among its own trajectories, its loss is normalised by its own token
count (a role's gradient never depends on how many tokens another role had), and its
optimizer steps touch only its adapter (the others get no gradient, and AdamW skips a
parameter without one: no momentum, no weight decay). A role without a trajectory in a
batch keeps its adapter unchanged. Every role shares the run's version: each step
publishes all of them at the new version (``rl_core.adapter_sync.RoleAdapterSync``).

The step's metrics are the run's as usual plus, for each role present, ``roles/<role>/...``:
the reward, its spread, the trajectories, response tokens and staleness of its part, and the
role's own advantage and PPO statistics under their usual keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rl_core import lora
from rl_core.metrics import StatsAccumulator
from rl_core.types import Trajectory


def split_by_role(
    batch: Sequence[Trajectory], roles: Sequence[str]
) -> list[tuple[str, list[Trajectory]]]:
    """``batch`` as ``(role, its trajectories)`` in the order of ``roles``, roles without a
    trajectory left out; ``[("", batch)]`` for a one-policy run (no roles).

    Raises ValueError for a trajectory whose role is not one of ``roles``.
    """
    if not roles:
        return [("", list(batch))]
    unknown = sorted({t.role for t in batch if t.role not in roles})
    if unknown:
        raise ValueError(
            f"trajectories of unknown roles {unknown}: this run trains the roles {list(roles)} "
            "(each trajectory names the role whose adapter produced it)"
        )
    parts = [(role, [t for t in batch if t.role == role]) for role in roles]
    return [(role, part) for role, part in parts if part]


def rollout_stats(batch: Sequence[Trajectory], version: int, discount: float) -> dict[str, float]:
    """The batch's staleness (versions behind ``version``) and rollout statistics."""
    lags = [version - t.oldest_version for t in batch]
    rewards = torch.tensor([t.reward(discount) for t in batch])  # [N]
    return {
        "staleness/max": float(max(lags)),
        "staleness/mean": sum(lags) / len(lags),
        "rollout/num_trajectories": float(len(batch)),
        "rollout/reward": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(batch) > 1 else 0.0,
        "rollout/response_tokens": sum(t.num_generated for t in batch) / len(batch),
        "rollout/seq_len": sum(len(t.input_ids) for t in batch) / len(batch),
    }


# A role's rollout statistics: its key -> rollout_stats' key.
_ROLE_ROLLOUT = {
    "reward": "rollout/reward",
    "reward_std": "rollout/reward_std",
    "num_trajectories": "rollout/num_trajectories",
    "response_tokens": "rollout/response_tokens",
    "staleness_max": "staleness/max",
}


def role_rollout_stats(
    role: str, part: Sequence[Trajectory], version: int, discount: float
) -> dict[str, float]:
    """``roles/<role>/reward``, ``reward_std``, ``num_trajectories``, ``response_tokens`` and
    ``staleness_max`` of one role's part of a batch."""
    stats = rollout_stats(part, version, discount)
    return prefixed(role, {key: stats[source] for key, source in _ROLE_ROLLOUT.items()})


def prefixed(role: str, stats: dict[str, float]) -> dict[str, float]:
    """``stats`` under ``roles/<role>/``; unchanged for a one-policy run (role "")."""
    return {f"roles/{role}/{k}": v for k, v in stats.items()} if role else dict(stats)


def params_by_role(model: Any, roles: Sequence[str]) -> dict[str, list[torch.nn.Parameter]]:
    """Each role's trainable parameters (its adapter's), in the model's order."""
    out: dict[str, list[torch.nn.Parameter]] = {role: [] for role in roles}
    for name, param in model.named_parameters():
        role = lora.adapter_of(name)
        if param.requires_grad and role in out:
            out[role].append(param)
    return out


class RoleStats:
    """The step's ``StatsAccumulator`` and one per role: what a role's update adds goes to
    both (``for_role``), so the run's statistics stay over the whole batch."""

    def __init__(self, total: StatsAccumulator):
        self.total = total
        self.by_role: dict[str, StatsAccumulator] = {}

    def for_role(self, role: str) -> Any:
        """What ``PPOTrainer`` adds a role's statistics to (the total alone without roles)."""
        if not role:
            return self.total
        self.by_role[role] = StatsAccumulator()
        return _Both(self.total, self.by_role[role])

    def role_results(self, *, reduce_across_ranks: bool) -> dict[str, float]:
        """Every role's statistics under ``roles/<role>/`` (a collective when reducing)."""
        out: dict[str, float] = {}
        for role, acc in self.by_role.items():
            stats = acc.result(reduce_across_ranks=reduce_across_ranks)
            stats.pop("ppo/n_tokens", None)
            out |= prefixed(role, stats)
        return out


class _Both:
    def __init__(self, *accs: StatsAccumulator):
        self.accs = accs

    def add(self, stats: dict[str, float], weight: float = 1.0) -> None:
        for acc in self.accs:
            acc.add(stats, weight)


def part_stats(
    parts: Sequence[tuple[str, Sequence[Trajectory]]],
    updates: Sequence[tuple[dict[str, float], list[float], list[float], int]],
    losses: Sequence[float],
) -> dict[str, float]:
    """The advantage statistics of a step's parts (``split_by_role``'s, each with its update:
    advantage statistics, minibatch losses, gradient norms, skipped steps), and each role's
    ``ppo/loss`` and ``ppo/grad_norm``. ``losses``: every part's minibatch losses in order,
    summed over the ranks. The batch's advantage statistics over several roles: the roles'
    means weighted by their trajectories, ``*_max`` keys the maximum."""
    if len(parts) == 1 and not parts[0][0]:
        return dict(updates[0][0])
    total = StatsAccumulator()
    out: dict[str, float] = {}
    start = 0
    for (role, part), (adv_stats, part_losses, norms, _) in zip(parts, updates, strict=True):
        total.add(adv_stats, weight=float(len(part)))
        mine = losses[start : start + len(part_losses)]  # this role's minibatches
        start += len(part_losses)
        out |= prefixed(role, adv_stats)
        out |= prefixed(
            role, {"ppo/loss": sum(mine) / len(mine), "ppo/grad_norm": sum(norms) / len(norms)}
        )
    return total.result() | out
