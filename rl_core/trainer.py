"""The PPO trainer: trajectories in, a new policy version out.

One ``train_step`` reads as its phases, each timed as ``timing/<phase>``:
advantages → pack → proximal (and reference) logprobs →
per minibatch: micro-batches with gradient accumulation → all-reduce →
clip → optimizer step; then the LR schedule and ``version += 1``.

Data parallel: when ``torch.distributed`` is initialised (by ``workers.trainer_group``'s
Ray actors, ``torchrun``, or a test), every rank calls ``train_step`` with the *same*
full batch. Advantages need whole groups, so each rank computes them for the whole
batch, then trains on its token-balanced shard of every minibatch; gradients are summed
across ranks (the loss is already divided by the whole minibatch's token count), so N
ranks take exactly the step one process would take on the whole batch. With
``train_workers > 1`` the model is sharded with FSDP2 (``rl_core.distributed``), which
reduces the gradients itself; otherwise ``_all_reduce_grads`` sums full replicas' ones.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from rl_core import lora, prefix_tree
from rl_core.advantages import token_advantages
from rl_core.attention import packed_attention_implementation
from rl_core.config import RunConfig
from rl_core.correction import MismatchMeter, correct, keeps_denominator
from rl_core.distill import distill_advantages
from rl_core.distill_topk import TOPK_IDS, TOPK_LOGPROBS, topk_extras
from rl_core.distributed import rank_micro_batches, tree_rank_micro_batches
from rl_core.failpoints import failpoint
from rl_core.hf import config_dtype
from rl_core.loss import LossConfig, ppo_loss, topk_forward_kl
from rl_core.memory import PeakMemory, enable_activation_checkpointing, resolve_precision
from rl_core.metrics import PhaseTimer, StatsAccumulator, logprob_gap
from rl_core.packing import PackedBatch, pack, packed_logprobs, packed_scores
from rl_core.roles import (
    RoleStats,
    params_by_role,
    part_stats,
    role_rollout_stats,
    rollout_stats,
    split_by_role,
)
from rl_core.sharded_load import load_sharded
from rl_core.trainer_saving import TrainerSaving
from rl_core.types import Trajectory
from rl_core.weight_sender import WeightSender, weight_metadata

logger = logging.getLogger(__name__)

_BUCKET_NUMEL = 32 * 1024 * 1024  # gradient values all-reduced at once (128 MiB in float32)


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at train step ``step`` (0-based).

    Linear warm-up reaches the full rate at step ``warmup_steps - 1``; then constant,
    linear decay or cosine decay (towards 0 at ``total_steps``).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule {schedule!r}; use constant, linear or cosine")


class PPOTrainer(TrainerSaving):
    """Decoupled-PPO trainer for any HF causal LM at a local path.

    Parameters and optimizer state stay in float32 (bf16 AdamW updates of a 1e-5
    learning rate round to nothing); with ``precision`` bf16 (``auto`` on CUDA) the
    forward runs under bf16 autocast (``self.precision`` is the resolved ``"fp32"`` or
    ``"bf16"``). Packed micro-batches use padding-free attention (``rl_core.attention``).
    With ``lora_rank > 0`` only a LoRA adapter is trained (``rl_core.lora``).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model_path: str | os.PathLike | None = None,
        device: str | torch.device | None = None,
    ):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.loss_cfg = LossConfig.from_run_config(cfg)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = torch.device(device) if device is not None else _default_device()
        # Weights (and tokenizer) from another run's checkpoint when the config says so.
        self.model_path = str(model_path or cfg.init_checkpoint or cfg.base_model)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        # What inference servers get: the base model's dtype, also when starting from a
        # (float32) checkpoint of another run.
        self.save_dtype = config_dtype(cfg.base_model if cfg.init_checkpoint else self.model_path)
        self.lora = cfg.lora_rank > 0
        self.precision = resolve_precision(cfg.precision, self.device)
        self.autocast_dtype = torch.bfloat16 if self.precision == "bf16" else None
        # More than one trainer process: FSDP2 shards parameters, gradients and optimizer
        # state, and each rank loads only its own shards (rl_core.sharded_load).
        # With cpu_offload also one worker shards (a group of one), to keep its state on the CPU.
        self.fsdp = self.distributed and (
            (self.world_size > 1 and cfg.train_workers > 1) or cfg.cpu_offload
        )
        if cfg.cpu_offload and not self.distributed:
            raise ValueError(
                "cpu_offload shards the trainer with FSDP2, which needs torch.distributed "
                "initialised (workers.trainer_group's workers do it, also for one worker)"
            )
        self.model = self._load(torch.float32, self._prepare_policy, self.autocast_dtype)
        self.ref_model = None  # with LoRA the reference is the model with its adapter off
        if cfg.kl_coef > 0 and not self.lora:
            self.ref_model = self._load(
                self.autocast_dtype or torch.float32, lambda m: m.eval().requires_grad_(False)
            )

        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # A multi-agent run's adapters (rl_core.roles): each role's step clips and reduces its own.
        self.role_params = params_by_role(self.model, cfg.roles)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, cfg.lr_schedule, cfg.lr_warmup_steps, cfg.max_steps),
        )
        self.version = 0
        self._sender = WeightSender()  # distributed weight updates (rl_core.weight_sync)

    def _load(self, dtype: torch.dtype, prepare: Callable[[Any], Any], param_dtype=None) -> Any:
        attention = packed_attention_implementation(self.device, tree=self.cfg.prefix_tree)
        if self.fsdp:
            return load_sharded(self.model_path, self.cfg, dtype, self.device, attention,
                                param_dtype=param_dtype, prepare=prepare,
                                offload=self.cfg.cpu_offload)  # fmt: skip
        model = lora.load_policy(self.model_path, self.cfg, dtype, self.device, attention)
        prepare(model)
        return model

    def _prepare_policy(self, model: Any) -> None:
        model.train()
        if self.cfg.gradient_checkpointing:
            enable_activation_checkpointing(model)

    # ------------------------------------------------------------------ training

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _saved_activations(self):
        """Where the forward keeps what the backward needs: on the device, or with
        ``activation_offload`` in (pinned) CPU memory, copied back as the backward uses it."""
        if not self.cfg.activation_offload:
            return nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One policy update from a batch of trajectories; returns metrics.

        Every token in ``loss_mask`` is trained: the caller masks stale tokens and drops
        trajectories with nothing fresh first (``rl_core.loop`` does, with
        ``rl_core.staleness.mask_stale``). ``staleness/max`` and ``staleness/mean``
        report how many versions behind the batch's oldest tokens are. A multi-agent run
        (``cfg.roles``) updates each role's adapter from its own trajectories, one role after
        the other, and adds ``roles/<role>/...`` statistics (``rl_core.roles``).
        """
        if not trajectories:
            raise ValueError("train_step needs at least one trajectory")
        cfg = self.cfg
        timer = PhaseTimer(sync_cuda=self.device.type == "cuda")
        memory = PeakMemory(self.device).start()
        started = time.perf_counter()
        batch = list(trajectories)
        parts = split_by_role(batch, cfg.roles)  # [("", batch)] in a one-policy run
        stats = rollout_stats(batch, self.version, cfg.turn_discount)
        acc = StatsAccumulator()
        role_stats = RoleStats(acc)
        mismatch = MismatchMeter(
            cfg.behav_imp_weight_cap, cfg.correction_ratio_low, cfg.correction_ratio_high
        )
        lr = float(self.scheduler.get_last_lr()[0])
        updates = []  # per part: (advantage stats, minibatch losses, grad norms, skipped steps)
        for role, part in parts:
            if role:
                stats.update(role_rollout_stats(role, part, self.version, cfg.turn_discount))
            with lora.active_adapter(self.model, role):
                updates.append(
                    self._update(
                        part, timer, role_stats.for_role(role), mismatch,
                        self.role_params.get(role, self.params),
                    )
                )  # fmt: skip
        losses = [loss for u in updates for loss in u[1]]
        grad_norms = [norm for u in updates for norm in u[2]]
        skipped = sum(u[3] for u in updates)

        with timer.phase("scheduler"):
            self.scheduler.step()
            self.version += 1

        with timer.phase("reduce_stats"):
            stats.update(acc.result(reduce_across_ranks=self.distributed))
            stats.update(mismatch.result(_gather_objects if self.distributed else None))
            stats.pop("ppo/n_tokens", None)
            stats.update(role_stats.role_results(reduce_across_ranks=self.distributed))
            loss_t = torch.tensor(losses, dtype=torch.float64, device=self._collective_device())
            if self.distributed:  # each rank holds its shard's part of every minibatch loss
                dist.all_reduce(loss_t)
            stats.update(part_stats(parts, updates, loss_t.tolist()))
        elapsed = time.perf_counter() - started
        tokens = sum(len(t.input_ids) for t in batch)
        stats.update(
            {
                "ppo/loss": loss_t.mean().item(),
                "ppo/grad_norm": sum(grad_norms) / len(grad_norms),
                "ppo/skipped_steps": float(skipped),
                "ppo/lr": lr,
                "perf/tokens_per_s": tokens / elapsed,
                "perf/step_s": elapsed,
                "perf/peak_memory_gb": memory.peak_gb(),
                "version": float(self.version),
                **timer.stats(),
            }
        )
        return stats

    def _update(
        self,
        batch: list[Trajectory],
        timer: PhaseTimer,
        acc: Any,
        mismatch: MismatchMeter,
        params: list[torch.nn.Parameter],
    ) -> tuple[dict[str, float], list[float], list[float], int]:
        """The optimizer steps of one batch (a multi-agent run: of one role, its adapter
        active, ``params`` its adapter's); its advantage statistics, minibatch losses,
        gradient norms and skipped steps."""
        cfg = self.cfg
        with timer.phase("advantages"):
            advantages, adv_stats = token_advantages(
                batch, cfg.resolved_advantage, cfg.turn_discount
            )
            # On-policy distillation (a self-distilling batch without hints: reward alone,
            # weighted as in every other batch of the run)
            if (
                cfg.teacher_url
                or cfg.teacher_pool
                or cfg.self_distill
                or any(t.teacher_logprobs is not None for t in batch)
            ):
                advantages = distill_advantages(
                    batch, advantages, cfg.reward_weight, cfg.distill_weight
                )

        with timer.phase("pack"):
            plan, (computed, flat) = self._plan(batch, advantages)

        # The tokens the model runs over per packed token: below 1 where prefix trees share.
        acc.add({"perf/computed_tokens_per_token": computed / max(flat, 1)}, weight=flat)
        with timer.phase("proximal_logprobs"), torch.no_grad(), self._autocast():
            for _, micro in plan:
                for mb in micro:
                    if cfg.use_decoupled_loss:
                        # Each token at its own turn's temperature (mb.temperatures), as its
                        # behaviour logprob was taken: see rl_core.sampling.
                        mb.extra["proximal"] = packed_logprobs(self.model, mb)[0]
                        gap, fresh = logprob_gap(
                            mb.extra["proximal"],
                            mb.logprobs,
                            mb.loss_mask,
                            mb.extra["versions"],
                            self.version,
                        )
                        acc.add(gap, weight=fresh)
                        mismatch.add(mb.extra["proximal"], mb.logprobs, mb.loss_mask, mb.seq_ids)
                    if cfg.kl_coef > 0:
                        with lora.reference(self.model, self.ref_model) as ref:
                            mb.extra["ref"] = packed_logprobs(ref, mb)[0]
            if cfg.use_decoupled_loss and not keeps_denominator(cfg.rollout_correction):
                plan = self._recounted(plan)  # what the correction masked leaves the denominator

        losses, grad_norms, skipped = [], [], 0
        for normalizer, micro in plan:
            loss_sum = 0.0
            with timer.phase("forward_backward"):
                for mb in micro:
                    with self._saved_activations():
                        loss, loss_stats = self._micro_batch_loss(mb, normalizer)
                    loss.backward()
                    loss_sum += loss_stats.pop("ppo/loss", 0.0)
                    acc.add(loss_stats, weight=loss_stats["ppo/n_tokens"])
            losses.append(loss_sum)
            with timer.phase("optimizer_step"):
                if self.distributed and not self.fsdp:  # FSDP2 reduced them in backward
                    self._all_reduce_grads(params)
                max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
                failpoint("train_step", self.version + 1)
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                else:  # one bad batch must not turn every weight into NaN
                    skipped += 1
                    logger.warning(
                        "Non-finite gradient norm at version %d; optimizer step skipped.",
                        self.version,
                    )
                self.optimizer.zero_grad(set_to_none=True)
                grad_norms.append(grad_norm)
        return adv_stats, losses, grad_norms, skipped

    def _plan(
        self, batch: list[Trajectory], advantages: list[torch.Tensor]
    ) -> tuple[list[tuple[float, list[PackedBatch]]], tuple[int, int]]:
        """Minibatches as ``(normalizer, this rank's packed micro-batches)``, and the tokens
        the model runs over on this rank with the tokens packed (``(computed, flat)``).

        Each minibatch's sequences are split over the ranks by token count
        (``rl_core.distributed.rank_micro_batches``). The minibatch order is a
        permutation seeded by (seed, version): the same on every rank and again after
        resuming from a checkpoint. With ``prefix_tree`` the permutation moves groups of
        sequences that share a prefix (``prefix_tree.clusters``), which stay together in a
        micro-batch where they fit, and the tokens counted are the trees'.
        """
        cfg = self.cfg
        versions = [torch.tensor(t.versions) for t in batch]  # [L_i] each
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.version)
        if cfg.prefix_tree:  # sequences that share a prefix stay in one minibatch where they fit
            groups_of = prefix_tree.clusters([t.input_ids for t in batch])
            order = [i for g in torch.randperm(len(groups_of), generator=gen) for i in groups_of[g]]
        else:
            order = torch.randperm(len(batch), generator=gen).tolist()
        n_minibatches = min(cfg.ppo_minibatches, len(batch))
        plan, tokens = [], [0, 0]
        for chunk in torch.tensor_split(torch.tensor(order), n_minibatches):
            members = chunk.tolist()
            # The whole minibatch's count, so micro-batch losses on every rank sum to its mean.
            if cfg.loss_agg == "seq_mean":
                normalizer = float(len(members))
            else:  # token 0 of a sequence is never trained (see pack)
                normalizer = float(sum(sum(batch[i].loss_mask[1:]) for i in members))
            if cfg.prefix_tree:
                groups, most = tree_rank_micro_batches(
                    [batch[i].input_ids for i in members],
                    self.world_size,
                    self.rank,
                    cfg.micro_batch_tokens,
                )
            else:
                lengths = [len(batch[i].input_ids) for i in members]
                groups, most = rank_micro_batches(
                    lengths, self.world_size, self.rank, cfg.micro_batch_tokens
                )
            # The teacher's top-k (distill_topk), [L_i, k] each, when the batch has it.
            extra = {"advantages": advantages, "versions": versions, **topk_extras(batch)}
            micro = [
                pack(batch, [members[j] for j in g], extra=extra, tree=cfg.prefix_tree).to(
                    self.device
                )
                for g in groups
            ]
            tokens[0] += sum(mb.computed_tokens for mb in micro)
            tokens[1] += sum(mb.num_tokens for mb in micro)
            if self.fsdp and len(micro) < most:
                # FSDP2 runs collectives in every forward and backward: match the busiest
                # rank with a micro-batch that trains nothing (no token in its loss mask).
                padding = pack(batch, [min(members, key=lambda i: len(batch[i].input_ids))], extra)
                padding.loss_mask.zero_()
                micro += [padding.to(self.device)] * (most - len(micro))
            plan.append((normalizer, micro))
        return plan, (tokens[0], tokens[1])

    def _recounted(
        self, plan: list[tuple[float, list[PackedBatch]]]
    ) -> list[tuple[float, list[PackedBatch]]]:
        """``plan`` with each minibatch's normalizer counting only what ``rollout_correction``
        keeps (tokens, or sequences for seq_mean), summed over the ranks."""
        cfg = self.cfg
        counts = []
        for _, micro in plan:
            kept = 0.0
            for mb in micro:
                _, keep = correct(
                    mb.extra["proximal"] - mb.logprobs, mb.loss_mask.bool(), mb.seq_ids,
                    cfg.rollout_correction, cfg.behav_imp_weight_cap,
                    cfg.correction_ratio_low, cfg.correction_ratio_high,
                )  # fmt: skip
                seqs = float(torch.unique(mb.seq_ids[keep]).numel())
                kept += seqs if cfg.loss_agg == "seq_mean" else float(keep.sum())
            counts.append(kept)
        total = torch.tensor(counts, dtype=torch.float64, device=self._collective_device())
        if self.distributed:
            dist.all_reduce(total)
        return [(max(n, 1.0), micro) for n, (_, micro) in zip(total.tolist(), plan, strict=True)]

    def _micro_batch_loss(
        self, mb: PackedBatch, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        topk_ids = mb.extra.get(TOPK_IDS)  # [T, k]: the teacher's top-k (distill_topk)
        with self._autocast():
            logprobs, entropy, topk = packed_scores(
                self.model,
                mb,
                topk_ids=topk_ids,
                with_entropy=True,
                entropy_grad=self.loss_cfg.entropy_coef > 0,
            )
        loss, stats = ppo_loss(
            logprobs,  # [T]
            mb.extra.get("proximal", mb.logprobs),  # [T]
            mb.logprobs,  # [T]
            mb.extra["advantages"],  # [T]
            mb.loss_mask,  # [T]
            self.loss_cfg,
            entropy=entropy,
            ref_logprobs=mb.extra.get("ref"),
            seq_ids=mb.seq_ids,
            normalizer=normalizer,
        )
        if topk is not None and self.cfg.distill_topk_coef > 0:
            kl, kl_stats = topk_forward_kl(
                topk, mb.extra[TOPK_LOGPROBS], mb.loss_mask, seq_ids=mb.seq_ids,
                loss_agg=self.loss_cfg.loss_agg, normalizer=normalizer,
            )  # fmt: skip
            loss = loss + self.cfg.distill_topk_coef * kl
            stats.update(kl_stats)
        return loss, stats

    def _all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks, a bucket of about 32M values at a time.

        Manual rather than a DDP wrapper: a rank whose shard of a minibatch is empty
        (batch smaller than the world) still joins, with zero gradients.
        """
        bucket: list[torch.Tensor] = []
        for p in params:  # (a multi-agent run: the active role's; the others keep no gradient)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            bucket.append(p.grad)
            if sum(g.numel() for g in bucket) >= _BUCKET_NUMEL:
                _all_reduce_bucket(bucket)
                bucket = []
        if bucket:
            _all_reduce_bucket(bucket)

    def _collective_device(self) -> torch.device:
        return (
            self.device
            if self.distributed and dist.get_backend() == "nccl"
            else torch.device("cpu")
        )

    # Distributed weight updates (rl_core.weight_sender): every rank calls each of them.

    def weight_metadata(self) -> dict[str, list]:
        return weight_metadata(self)

    def init_weight_group(self, **kwargs: Any) -> None:
        self._sender.init_group(self, **kwargs)

    def broadcast_weights(self, group_name: str) -> dict[str, Any]:
        return self._sender.broadcast(self, group_name)

    def destroy_weight_group(self, group_name: str) -> None:
        self._sender.destroy(group_name)


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numel]
    dist.all_reduce(flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def _gather_objects(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
