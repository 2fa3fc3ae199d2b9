"""Decoupled PPO loss (Hilton et al. 2022, "Batch size-invariance for policy optimization";
as used for asynchronous RL by AReaL, Fu et al. 2025).

Three policies per token: behaviour ``b`` (the inference server that sampled it,
possibly several versions old), proximal ``p`` (the weights at the start of this
training step, recomputed) and current ``θ``. The trust region is taken around
``p``, and ``w = exp(p - b)`` corrects for sampling from ``b``::

    L = -agg_t[ w_t · min(r_t·A_t, clip(r_t, 1-ε, 1+ε_high)·A_t) ],   r_t = exp(θ_t - p_t)

``use_decoupled_loss=False`` sets ``p = b`` (standard PPO, ``w = 1``). Which tokens ``w`` lets
train, and how it is capped, is the run's ``rollout_correction`` (``rl_core.correction``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_core.correction import correct, keeps_denominator


@dataclass(frozen=True)
class LossConfig:
    """The loss-related part of ``RunConfig`` (see its field help for each option)."""

    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    dual_clip: float | None = None
    behav_imp_weight_cap: float | None = 5.0
    rollout_correction: str = "cap_mask"
    correction_ratio_low: float = 0.5
    correction_ratio_high: float = 2.0
    ratio_level: str = "token"
    loss_agg: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    use_decoupled_loss: bool = True

    @classmethod
    def from_run_config(cls, cfg: Any) -> LossConfig:
        return cls(**{name: getattr(cfg, name) for name in cls.__dataclass_fields__})


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from samples of π_θ (Schulman 2020, "Approximating
    KL Divergence", http://joschu.net/blog/kl-approx.html).

    k1 = log π_θ - log π_ref (unbiased, high variance, can be negative);
    k3 = (ρ - 1) - log ρ with ρ = π_ref / π_θ (unbiased, low variance, always >= 0).
    """
    log_rho = ref_logprobs - logprobs  # [T]
    if estimator == "k1":
        return -log_rho
    if estimator == "k3":
        return torch.expm1(log_rho) - log_rho
    raise ValueError(f"unknown kl_estimator {estimator!r}; use k1 or k3")


def _segment_sum(values: torch.Tensor, seq_ids: torch.Tensor, n: int) -> torch.Tensor:
    return values.new_zeros(n).index_add(0, seq_ids, values)  # [S]


def ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
    *,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss over tokens; returns ``(loss, stats)``.

    All tensors share one shape: ``[T]`` (packed) or ``[B, T]`` (rows are sequences).
    ``logprobs`` (and ``entropy``) carry gradients; the others are treated as constants.
    ``seq_ids`` (``[T]`` ints in ``0..S-1``) names each token's sequence; it is needed for
    ``ratio_level="sequence"`` and ``loss_agg="seq_mean"`` with packed input.

    ``normalizer`` divides the summed loss instead of this call's own count (masked
    tokens for token_mean, sequences for seq_mean): with gradient accumulation, pass
    the whole minibatch's count so the micro-batch losses add up to the exact minibatch mean.
    """
    if cfg.ratio_level not in ("token", "sequence"):
        raise ValueError(f"unknown ratio_level {cfg.ratio_level!r}; use token or sequence")
    if seq_ids is None and logprobs.dim() == 2:
        seq_ids = torch.arange(logprobs.shape[0], device=logprobs.device)[:, None].expand_as(
            logprobs
        )
    if seq_ids is None and (cfg.ratio_level == "sequence" or cfg.loss_agg == "seq_mean"):
        raise ValueError(
            "ratio_level='sequence' and loss_agg='seq_mean' need seq_ids for packed (1-D) input"
        )
    theta = logprobs.reshape(-1)  # [T]
    behav = behaviour_logprobs.reshape(-1).detach()  # [T]
    prox = proximal_logprobs.reshape(-1).detach() if cfg.use_decoupled_loss else behav  # [T]
    adv = advantages.reshape(-1).detach()  # [T]
    mask = loss_mask.reshape(-1).bool()  # [T]
    ent = entropy.reshape(-1) if entropy is not None else None  # [T]
    ref = ref_logprobs.reshape(-1).detach() if ref_logprobs is not None else None  # [T]
    # [T]; the zeros are never read: the sequence options required seq_ids above.
    sid = seq_ids.reshape(-1) if seq_ids is not None else torch.zeros_like(theta, dtype=torch.long)
    n_tokens = int(mask.sum())
    if n_tokens == 0:  # keep the graph so every rank still runs backward
        return (theta * 0.0).sum(), {"ppo/n_tokens": 0.0}

    # Behaviour importance weight w = exp(p - b), and the tokens it lets train
    # (rl_core.correction: by default those over behav_imp_weight_cap are masked).
    behav_w, valid = correct(
        prox - behav,
        mask,
        sid,
        cfg.rollout_correction,
        cfg.behav_imp_weight_cap,
        cfg.correction_ratio_low,
        cfg.correction_ratio_high,
    )  # [T] each
    # Tokens a band or a sequence rejection masks leave the denominator; the cap's stay.
    counted = mask if keeps_denominator(cfg.rollout_correction) else valid  # [T]

    log_ratio = torch.where(mask, theta - prox, 0.0)  # [T]
    if cfg.ratio_level == "sequence":
        # Geometric mean of the token ratios of each sequence, shared by its tokens
        # (Zheng et al. 2025, "Group Sequence Policy Optimization").
        n_seq = int(sid.max()) + 1
        counts = _segment_sum(valid.float(), sid, n_seq).clamp(min=1)  # [S]
        seq_log_ratio = _segment_sum(torch.where(valid, log_ratio, 0.0), sid, n_seq) / counts  # [S]
        ratio = torch.exp(seq_log_ratio)[sid]  # [T]
    else:
        ratio = torch.exp(log_ratio)  # [T]

    eps_high = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    surr = ratio * adv  # [T]
    surr_clipped = torch.clamp(ratio, 1.0 - cfg.eps_clip, 1.0 + eps_high) * adv  # [T]
    pg = -torch.minimum(surr, surr_clipped)  # [T]
    clipped = surr_clipped < surr  # [T]
    dual_clipped = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        # Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"):
        # for A < 0 the objective is max(min(r·A, clip(r)·A), c·A), bounding the loss of a
        # huge ratio on a bad token at -c·A.
        bound = -cfg.dual_clip * adv  # [T]
        dual_clipped = (adv < 0) & (pg > bound)
        pg = torch.where(dual_clipped, bound, pg)
    pg = pg * torch.where(valid, behav_w, 0.0)  # [T]

    per_token = pg  # [T]
    kl = None
    if ref is not None and cfg.kl_coef > 0:
        kl = kl_penalty(theta, ref, cfg.kl_estimator)  # [T]
        per_token = per_token + cfg.kl_coef * kl
    if ent is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * ent
    per_token = torch.where(mask, per_token, 0.0)  # [T]

    per_token = torch.where(counted, per_token, 0.0)  # [T]
    if cfg.loss_agg == "seq_mean":
        n_seq = int(sid.max()) + 1
        tokens_per_seq = _segment_sum(counted.float(), sid, n_seq)  # [S]
        seq_loss = _segment_sum(per_token, sid, n_seq) / tokens_per_seq.clamp(min=1)  # [S]
        denom = normalizer if normalizer is not None else float((tokens_per_seq > 0).sum())
        loss = seq_loss.sum() / max(denom, 1.0)
    elif cfg.loss_agg == "token_mean":
        denom = normalizer if normalizer is not None else float(counted.sum())
        loss = per_token.sum() / max(denom, 1.0)
    else:
        raise ValueError(f"unknown loss_agg {cfg.loss_agg!r}; use token_mean or seq_mean")

    with torch.no_grad():
        m = mask.float()
        token_log_ratio = (theta - prox).detach()  # [T]
        # k3 estimate of KL(p || θ) from tokens sampled (nearly) from p: the drift this step.
        approx_kl = torch.expm1(token_log_ratio) - token_log_ratio  # [T]
        masked_w = behav_w[mask]
        stats = {
            "ppo/n_tokens": float(n_tokens),
            "ppo/loss": loss.item(),
            "ppo/pg_loss": (pg * m).sum().item() / n_tokens,
            "ppo/clip_frac": ((clipped & valid).float().sum() / n_tokens).item(),
            "ppo/dual_clip_frac": ((dual_clipped & valid).float().sum() / n_tokens).item(),
            "ppo/approx_kl": ((approx_kl * m).sum() / n_tokens).item(),
            "ppo/ratio_mean": ((ratio.detach() * m).sum() / n_tokens).item(),
            "ppo/behav_imp_weight": masked_w.mean().item(),
            "ppo/behav_imp_weight_max": masked_w.max().item(),
            "ppo/behav_masked_frac": 1.0 - valid.float().sum().item() / n_tokens,
        }
        if ent is not None:
            stats["ppo/entropy"] = ((ent.detach() * m).sum() / n_tokens).item()
        if kl is not None:
            stats["ppo/kl_ref"] = ((kl.detach() * m).sum() / n_tokens).item()
    return loss, stats


def topk_forward_kl(
    student_topk_logprobs: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    seq_ids: torch.Tensor | None = None,
    loss_agg: str = "token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL from the teacher to the student on the teacher's top-k tokens; ``(loss, stats)``.

    Per trained token ``t``, with ``S_t`` the teacher's ``k`` likeliest tokens there::

        KL_t = sum_{i in S_t} p_T(i) * (log p_T(i) - log p_S(i))

    Not renormalised: ``log p_S`` is the student's full-vocabulary logprob (a softmax over
    every token) and ``p_T`` the teacher's own probabilities, which sum to the top-k's mass
    ``m_t <= 1``. This is NeMo-RL's ``DistillationLossFn`` with ``kl_type="forward"`` and
    ``zero_outside_topk=True`` (the teacher's tail dropped), the dense top-k supervision of
    GKD (Agarwal et al. 2024) and Thinking Machines' "On-Policy Distillation" (2025). Its
    gradient ``-sum_i p_T(i) * grad log p_S(i)`` raises the teacher's likely tokens whether or
    not the student sampled them, and through the softmax lowers everything else; renormalising
    over the top-k (NeMo-RL's default) would leave the student's mass outside them untouched.
    ``KL_t`` is 0 where the student equals the teacher and at least ``m_t log m_t >= -1/e``.

    ``student_topk_logprobs``, ``teacher_topk_logprobs``: ``[T, k]`` (the student's carry
    gradients); a teacher entry of ``-inf`` is padding (weight 0). ``mask``: ``[T]`` trained
    tokens. Aggregated as ``ppo_loss`` aggregates (``loss_agg``, ``seq_ids``, ``normalizer``),
    so that added to it the term has the same per-token weight.
    """
    student = student_topk_logprobs.float()  # [T, k]
    teacher = teacher_topk_logprobs.detach().float()  # [T, k]
    present = torch.isfinite(teacher)  # [T, k]
    teacher = torch.where(present, teacher, 0.0)
    p_teacher = torch.where(present, teacher.exp(), 0.0)  # [T, k]
    per_token = (p_teacher * (teacher - student)).sum(-1)  # [T]
    m = mask.reshape(-1).bool()  # [T]
    per_token = torch.where(m, per_token, 0.0)
    n_tokens = int(m.sum())
    if n_tokens == 0:
        return (student * 0.0).sum(), {}
    if loss_agg == "seq_mean":
        if seq_ids is None:
            raise ValueError("loss_agg='seq_mean' needs seq_ids")
        n_seq = int(seq_ids.max()) + 1
        tokens_per_seq = _segment_sum(m.float(), seq_ids, n_seq)  # [S]
        seq_loss = _segment_sum(per_token, seq_ids, n_seq) / tokens_per_seq.clamp(min=1)  # [S]
        denom = normalizer if normalizer is not None else float((tokens_per_seq > 0).sum())
        loss = seq_loss.sum() / max(denom, 1.0)
    elif loss_agg == "token_mean":
        denom = normalizer if normalizer is not None else float(n_tokens)
        loss = per_token.sum() / max(denom, 1.0)
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; use token_mean or seq_mean")
    with torch.no_grad():
        stats = {
            "distill/topk_forward_kl": float(per_token.sum()) / n_tokens,
            "distill/topk_teacher_mass": float(p_teacher.sum(-1)[m].sum()) / n_tokens,
        }
    return loss, stats
