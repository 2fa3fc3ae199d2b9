"""Rollout correction: what training does with tokens whose behaviour log-probability (the
engine's, as it sampled them) is far from the trainer's proximal recomputation.

Staleness is one cause; others are not (bf16 kernels, batch-variant reductions, a sampler's
top-p/top-k truncation, one engine against another) and long agent trajectories accumulate
them. Per token the decoupled loss weights by the behaviour ratio (``rl_core.loss``)::

    w_t = exp(p_t - b_t)        p: proximal logprob (recomputed), b: behaviour logprob

Run setting ``rollout_correction`` (band ``[lo, hi]`` = ``correction_ratio_low/high``,
cap ``C`` = ``behav_imp_weight_cap``):

- ``cap_mask`` (the default, Steep's behaviour before this setting): a token with ``w_t > C``
  gets no loss (AReaL's ``behav_imp_weight_cap``); it still counts in the denominator.
- ``truncate``: truncated importance sampling, ``w_t ← min(w_t, C)``, nothing masked (Ionides
  2008; for LLM RL Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
  RL Training", which TRL applies to vLLM rollouts).
- ``token_band``: a token with ``w_t`` outside ``[lo, hi]`` is masked (masked importance
  sampling; IcePop, Ling Team 2025; verl's token-level rejection in its rollout-correction
  guide); the rest keep ``w_t``.
- ``sequence_reject``: a sequence whose geometric-mean ratio
  ``ρ_s = exp(mean_{t in s} log w_t)`` is outside ``[lo, hi]`` is masked whole (verl's
  geometric sequence-level rejection; AReaL's sequence-level rejection); the rest keep ``w_t``.

Tokens that ``token_band`` and ``sequence_reject`` mask leave the loss's denominator (the
trainer recounts each minibatch's tokens, or sequences, after the proximal pass).

``MismatchMeter`` measures the gap every step whatever the setting (``correction/`` metrics):
the log-ratio ``log w_t`` over trained tokens (mean and percentiles), the k3 estimate of
KL(behaviour || proximal) (Schulman 2020: ``(w - 1) - log w``, unbiased from the behaviour's
samples, >= 0), and the share of tokens and sequences each correction would mask (truncate:
would cap).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_core.config import ROLLOUT_CORRECTIONS as MODES


def keeps_denominator(mode: str) -> bool:
    """Whether a masked token still counts in the loss's denominator under ``mode``."""
    return mode in ("cap_mask", "truncate")


def sequence_log_ratio(
    log_w: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor
) -> torch.Tensor:
    """Each token's sequence's mean ``log w`` over its masked-in tokens, ``[T]``."""
    n = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    m = mask.float()
    total = log_w.new_zeros(n).index_add(0, seq_ids, log_w * m)  # [S]
    count = log_w.new_zeros(n).index_add(0, seq_ids, m).clamp(min=1)  # [S]
    return (total / count)[seq_ids]  # [T]


def correct(
    log_w: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    mode: str,
    cap: float | None,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, keep)`` per token ``[T]`` under ``mode``: the behaviour weight each trained
    token's loss is multiplied by, and which tokens train at all (within ``mask``)."""
    w = torch.exp(log_w)  # [T]
    if mode == "cap_mask":
        return w, mask if cap is None else mask & (w <= cap)
    if mode == "truncate":
        return (w if cap is None else w.clamp(max=cap)), mask
    if mode == "token_band":
        return w, mask & (w >= low) & (w <= high)
    if mode == "sequence_reject":
        rho = torch.exp(sequence_log_ratio(log_w, mask, seq_ids))  # [T]
        return w, mask & (rho >= low) & (rho <= high)
    raise ValueError(f"unknown rollout_correction {mode!r}; use one of {', '.join(MODES)}")


class MismatchMeter:
    """The behaviour/proximal gap of one step's trained tokens, over its micro-batches (and
    ranks): ``add`` each micro-batch, then ``result``."""

    QUANTILES = (0.01, 0.5, 0.99)

    def __init__(self, cap: float | None, low: float, high: float) -> None:
        self.cap, self.low, self.high = cap, low, high
        self.log_ratios: list[torch.Tensor] = []
        self.sums: dict[str, float] = {}

    def add(
        self,
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
        mask: torch.Tensor,
        seq_ids: torch.Tensor,
    ) -> None:
        mask = mask.bool()
        log_w = (proximal - behaviour).detach().float()  # [T]
        self.log_ratios.append(log_w[mask].cpu())
        seqs = torch.unique(seq_ids[mask])
        add = self._add
        add("tokens", float(mask.sum()))
        add("seqs", float(seqs.numel()))
        add("kl_k3", float((torch.expm1(log_w) - log_w)[mask].sum()))
        for mode in MODES:
            weights, keep = correct(log_w, mask, seq_ids, mode, self.cap, self.low, self.high)
            if mode == "truncate":  # nothing masked: what was capped
                touched = mask & (weights < torch.exp(log_w))
            else:
                touched = mask & ~keep
            add(f"tokens/{mode}", float(touched.sum()))
            add(f"seqs/{mode}", float(torch.unique(seq_ids[touched]).numel()))

    def _add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def result(self, gather: Callable[[Any], list[Any]] | None = None) -> dict[str, float]:
        """The step's ``correction/`` metrics; ``gather(obj)`` collects every rank's (e.g.
        ``torch.distributed.all_gather_object``), None for one process."""
        parts = [(self.sums, self.log_ratios)]
        if gather is not None:
            parts = gather((self.sums, self.log_ratios))
        sums: dict[str, float] = {}
        ratios: list[torch.Tensor] = []
        for rank_sums, rank_ratios in parts:
            for key, value in rank_sums.items():
                sums[key] = sums.get(key, 0.0) + value
            ratios += rank_ratios
        tokens, seqs = sums.get("tokens", 0.0), sums.get("seqs", 0.0)
        if not tokens:
            return {}
        log_w = torch.cat(ratios).double()
        # Nearest-rank percentiles from one sort (torch.quantile refuses above 2^24 values).
        ordered = log_w.sort().values
        last = ordered.numel() - 1
        quantiles = torch.stack([ordered[round(q * last)] for q in self.QUANTILES])
        stats = {
            "correction/log_ratio_mean": log_w.mean().item(),
            **{
                f"correction/log_ratio_p{round(q * 100):02d}": v
                for q, v in zip(self.QUANTILES, quantiles.tolist(), strict=True)
            },
            "correction/kl_k3": sums["kl_k3"] / tokens,
        }
        for mode in MODES:
            verb = "capped" if mode == "truncate" else "masked"
            stats[f"correction/{verb}_tokens/{mode}"] = sums[f"tokens/{mode}"] / tokens
            stats[f"correction/{verb}_seqs/{mode}"] = sums[f"seqs/{mode}"] / max(seqs, 1.0)
        return stats
