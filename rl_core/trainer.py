"""The PPO trainer: trajectories in, a new policy version out.

One ``train_step`` reads as its phases, each timed as ``timing/<phase>``:
advantages → pack → proximal (and reference) logprobs →
per minibatch: micro-batches with gradient accumulation → all-reduce →
clip → optimizer step; then the LR schedule and ``version += 1``.

Data parallel: when ``torch.distributed`` is initialised (by ``torchrun``, Ray
Train, or a test), every rank calls ``train_step`` with the *same* full batch.
Advantages need whole groups, so each rank computes them for the whole batch,
then trains on its shard of every minibatch; gradients are summed across ranks
(the loss is already divided by the whole minibatch's token count), so N ranks
take exactly the step one process would take on the whole batch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from rl_core.advantages import token_advantages
from rl_core.config import RunConfig
from rl_core.loss import LossConfig, ppo_loss
from rl_core.metrics import PhaseTimer, StatsAccumulator
from rl_core.packing import PackedBatch, micro_batches, pack, packed_logprobs
from rl_core.types import Trajectory

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
_BUCKET_NUMEL = 32 * 1024 * 1024  # gradient values all-reduced at once (128 MiB in float32)
_TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "*.jinja",
    "chat_template*",
    "*.model",
)


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


def _dtype_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    # `dtype` replaced `torch_dtype` in transformers 4.56; older releases ignore it.
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype, device: torch.device) -> Any:
    """A HF causal LM from a local directory (or hub id), dropout disabled.

    Dropout off keeps θ == p at the start of a step (ratio exactly 1) and makes the
    recomputed logprobs deterministic; RL fine-tuning does not want it anyway.
    """
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), **_dtype_kwargs(dtype))
    model.to(device)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _config_dtype(path: str | os.PathLike) -> torch.dtype:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path))
    dtype = cfg.__dict__.get("dtype") or cfg.__dict__.get("torch_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


class PPOTrainer:
    """Decoupled-PPO trainer for any HF causal LM at a local path.

    Parameters and optimizer state stay in float32 (bf16 AdamW updates of a 1e-5
    learning rate round to nothing); on CUDA the forward runs under bf16 autocast.
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
        self.save_dtype = _config_dtype(cfg.base_model if cfg.init_checkpoint else self.model_path)
        self.model = load_causal_lm(self.model_path, torch.float32, self.device)
        self.model.train()
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = load_causal_lm(
                self.model_path, self.autocast_dtype or torch.float32, self.device
            )
            self.ref_model.eval().requires_grad_(False)

        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, cfg.lr_schedule, cfg.lr_warmup_steps, cfg.max_steps),
        )
        self.version = 0
        # Inference servers report logprobs of the raw logits (temperature 1, before
        # top-p/top-k; see rl_core.inference), so behaviour, proximal and current
        # logprobs are all the same quantity.
        self.temperature = 1.0

    # ------------------------------------------------------------------ training

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One policy update from a batch of trajectories; returns metrics.

        Every trajectory is trained: the caller drops stale ones first (``rl_core.loop``
        does, with ``rl_core.staleness.is_fresh``). ``staleness/max`` and ``staleness/mean``
        report how many versions behind the batch's oldest tokens are.
        """
        if not trajectories:
            raise ValueError("train_step needs at least one trajectory")
        cfg = self.cfg
        timer = PhaseTimer(sync_cuda=self.device.type == "cuda")
        started = time.perf_counter()
        batch = list(trajectories)
        lags = [self.version - t.oldest_version for t in batch]
        rewards = torch.tensor([t.reward(cfg.turn_discount) for t in batch])  # [N]
        stats: dict[str, float] = {
            "staleness/max": float(max(lags)),
            "staleness/mean": sum(lags) / len(lags),
            "rollout/num_trajectories": float(len(batch)),
            "rollout/reward": rewards.mean().item(),
            "rollout/reward_std": rewards.std().item() if len(batch) > 1 else 0.0,
            "rollout/response_tokens": sum(t.num_generated for t in batch) / len(batch),
            "rollout/seq_len": sum(len(t.input_ids) for t in batch) / len(batch),
        }

        with timer.phase("advantages"):
            advantages, adv_stats = token_advantages(
                batch, cfg.resolved_advantage, cfg.turn_discount
            )
        stats.update(adv_stats)

        with timer.phase("pack"):
            plan = self._plan(batch, advantages)

        with timer.phase("proximal_logprobs"), torch.no_grad(), self._autocast():
            for _, micro in plan:
                for mb in micro:
                    if cfg.use_decoupled_loss:
                        mb.extra["proximal"] = packed_logprobs(
                            self.model, mb, temperature=self.temperature
                        )[0]
                    if self.ref_model is not None:
                        mb.extra["ref"] = packed_logprobs(
                            self.ref_model, mb, temperature=self.temperature
                        )[0]

        acc = StatsAccumulator()
        losses, grad_norms, skipped = [], [], 0
        lr = float(self.scheduler.get_last_lr()[0])
        for normalizer, micro in plan:
            loss_sum = 0.0
            with timer.phase("forward_backward"):
                for mb in micro:
                    loss, loss_stats = self._micro_batch_loss(mb, normalizer)
                    loss.backward()
                    loss_sum += loss_stats.pop("ppo/loss", 0.0)
                    acc.add(loss_stats, weight=loss_stats["ppo/n_tokens"])
            losses.append(loss_sum)
            with timer.phase("optimizer_step"):
                if self.distributed:
                    self._all_reduce_grads()
                max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm).item()
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

        with timer.phase("scheduler"):
            self.scheduler.step()
            self.version += 1

        with timer.phase("reduce_stats"):
            stats.update(acc.result(reduce_across_ranks=self.distributed))
            stats.pop("ppo/n_tokens", None)
            loss_t = torch.tensor(losses, dtype=torch.float64, device=self._collective_device())
            if self.distributed:  # each rank holds its shard's part of every minibatch loss
                dist.all_reduce(loss_t)
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
                "version": float(self.version),
                **timer.stats(),
            }
        )
        return stats

    def _plan(
        self, batch: list[Trajectory], advantages: list[torch.Tensor]
    ) -> list[tuple[float, list[PackedBatch]]]:
        """Minibatches as ``(normalizer, this rank's packed micro-batches)``.

        The minibatch order is a permutation seeded by (seed, version): the same on
        every rank and again after resuming from a checkpoint.
        """
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.version)
        order = torch.randperm(len(batch), generator=gen).tolist()
        n_minibatches = min(cfg.ppo_minibatches, len(batch))
        plan = []
        for chunk in torch.tensor_split(torch.tensor(order), n_minibatches):
            members = chunk.tolist()
            # The whole minibatch's count, so micro-batch losses on every rank sum to its mean.
            if cfg.loss_agg == "seq_mean":
                normalizer = float(len(members))
            else:  # token 0 of a sequence is never trained (see pack)
                normalizer = float(sum(sum(batch[i].loss_mask[1:]) for i in members))
            shard = members[self.rank :: self.world_size]
            lengths = [len(batch[i].input_ids) for i in shard]
            micro = [
                pack(batch, [shard[j] for j in group], extra={"advantages": advantages}).to(
                    self.device
                )
                for group in micro_batches(lengths, cfg.micro_batch_tokens)
            ]
            plan.append((normalizer, micro))
        return plan

    def _micro_batch_loss(
        self, mb: PackedBatch, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        with self._autocast():
            logprobs, entropy = packed_logprobs(
                self.model,
                mb,
                temperature=self.temperature,
                with_entropy=True,
                entropy_grad=self.loss_cfg.entropy_coef > 0,
            )
        return ppo_loss(
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

    def _all_reduce_grads(self) -> None:
        """Sum gradients over ranks, a bucket of about 32M values at a time.

        Manual rather than a DDP wrapper: a rank whose shard of a minibatch is empty
        (batch smaller than the world) still joins, with zero gradients.
        """
        bucket: list[torch.Tensor] = []
        for p in self.params:
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

    # ------------------------------------------------------------------ saving

    def save_weights(self, path: str | os.PathLike) -> str:
        """HF-format weights (safetensors, in the base model's dtype) + config + tokenizer.

        Loadable by ``from_pretrained`` and by SGLang's ``/update_weights_from_disk``.
        Written atomically by rank 0; every rank must call it. Returns the directory.
        """
        state = {k: v.detach().to(self.save_dtype) for k, v in self.model.state_dict().items()}
        return self._save(Path(path), state, self.save_dtype, extra=None)

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Everything needed to resume exactly: float32 weights, tokenizer, optimizer,
        LR schedule, policy version and RNG states. Rank 0 writes; every rank must call it."""
        extra = {
            "version": self.version,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "python": random.getstate(),
            },
            "config": self.cfg.to_dict(),
        }
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        return self._save(Path(path), state, torch.float32, extra=extra)

    def _save(
        self, path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype, extra: dict | None
    ) -> str:
        if self.rank == 0:
            # Write beside the target and swap in, so a crash never leaves a half-written directory.
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self.model.save_pretrained(tmp, state_dict=state)
            self._save_tokenizer(tmp)
            # save_pretrained records the in-memory (float32) dtype; record the tensors' dtype.
            config_file = tmp / "config.json"
            config = json.loads(config_file.read_text())
            for key in ("dtype", "torch_dtype"):
                if key in config:
                    config[key] = str(dtype).removeprefix("torch.")
            config_file.write_text(json.dumps(config, indent=2))
            if extra is not None:
                torch.save(extra, tmp / TRAINER_STATE)
            old = path.with_name(path.name + ".old")
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        if self.distributed:
            dist.barrier()
        return str(path)

    def _save_tokenizer(self, directory: Path) -> None:
        # Copy the base model's own tokenizer files when it is local: re-saving would
        # rewrite tokenizer_config.json in this transformers version's format, which
        # an inference server pinned to another version may not read.
        source = Path(self.model_path)
        files = (
            [f for pattern in _TOKENIZER_FILES for f in source.glob(pattern)]
            if source.is_dir()
            else []
        )
        if not files:
            self.tokenizer.save_pretrained(directory)
        for f in files:
            shutil.copy2(f, directory / f.name)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a ``save_checkpoint`` directory: the next ``train_step`` continues the run exactly."""
        from safetensors.torch import load_file

        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in checkpoint {path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f), device=str(self.device)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # Tied weights (e.g. lm_head = embed_tokens) are saved once; anything else missing is an error.
        loaded_ptrs = {t.data_ptr() for k, t in self.model.state_dict().items() if k in state}
        untied = [k for k in missing if self.model.state_dict()[k].data_ptr() not in loaded_ptrs]
        if untied or unexpected:
            raise RuntimeError(
                f"checkpoint {path} does not match the model: missing {untied}, unexpected {unexpected}"
            )
        extra = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self.version = int(extra["version"])
        torch.set_rng_state(extra["rng"]["torch"])
        if extra["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["rng"]["cuda"])
        random.setstate(_as_random_state(extra["rng"]["python"]))


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numel]
    dist.all_reduce(flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def _as_random_state(state: Any) -> tuple:
    # random.setstate wants nested tuples; a round trip through torch.save may hand back lists.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
