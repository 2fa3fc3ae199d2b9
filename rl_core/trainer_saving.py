"""What a trainer saves and loads: HF-format weights for inference servers, LoRA adapters,
and checkpoints that resume a run exactly.

``TrainerSaving`` is ``rl_core.trainer.PPOTrainer``'s saving half (a mixin over its model,
optimizer, scheduler and version). Every method here is called by every rank of a
distributed trainer: under FSDP2 the full tensors are gathered onto rank 0, the only writer,
and the ranks meet at a barrier after each write.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_core import lora
from rl_core.config import RunConfig
from rl_core.distributed import (
    broadcast_from_rank0,
    full_model_state,
    full_optimizer_state,
    load_full_state,
    load_sharded_optimizer,
    on_rank0,
    optimizer_state_by_index,
    optimizer_state_by_name,
    save_sharded_optimizer,
)
from rl_core.failpoints import failpoint
from rl_core.hf import TOKENIZER_FILES, read_safetensors, record_dtype
from rl_core.sharded_load import fill_from_files
from rl_core.streamed_weights import Entry, serving_entries, stream, write_config, write_folder

TRAINER_STATE = "trainer_state.pt"
OPTIMIZER_DIR = "optimizer"  # a sharded checkpoint's optimizer state (torch.distributed.checkpoint)


class TrainerSaving:
    """Saving and loading for ``PPOTrainer`` (see there for the attributes it reads)."""

    cfg: RunConfig
    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    tokenizer: Any
    model_path: str
    save_dtype: torch.dtype
    device: torch.device
    version: int
    rank: int
    world_size: int
    distributed: bool
    fsdp: bool
    lora: bool

    def save_weights(self, path: str | os.PathLike) -> str:
        """HF-format weights (safetensors, in the base model's dtype) + config + tokenizer.

        Loadable by ``from_pretrained`` and by SGLang's ``/update_weights_from_disk``; a LoRA
        run's adapter is merged in. Streamed a tensor at a time (``rl_core.streamed_weights``):
        under FSDP2 the ranks write the files in turn, never gathering the model. Every rank
        must call it. Returns the directory.
        """
        entries = serving_entries(self.model, self.save_dtype, is_lora=self.lora)
        return self._save(Path(path), None, self.save_dtype, extra=None, streamed=entries)

    def save_adapter(self, path: str | os.PathLike, role: str = "") -> str:
        """A LoRA run's adapter alone (peft format), for the servers' ``/load_lora_adapter``
        (``rl_core.adapter_sync``); a multi-agent run's: ``role``'s (every role's in
        ``roles/<role>/`` when ``role`` is ""). Rank 0 writes; every rank must call it."""
        if not self.lora:
            raise ValueError("save_adapter needs a LoRA run (lora_rank > 0)")
        adapter = full_model_state(self.model, trainable_only=True) if self.fsdp else None
        return self._save(Path(path), None, torch.float32, extra=None, adapter=adapter, role=role)

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Everything needed to resume exactly: float32 weights (a LoRA run's: the adapter
        only), tokenizer, optimizer (keyed by parameter name, so any number of workers can
        resume it), LR schedule, policy version and RNG states. Every rank must call it.

        Under FSDP2 a full fine-tuning run's checkpoint is written by every rank, never
        gathered: the weights as safetensors files written in turn (``rl_core.streamed_weights``),
        the optimizer as ``torch.distributed.checkpoint`` files in ``optimizer/`` (each rank its
        shards). Otherwise rank 0 writes it all (``trainer_state.pt`` holds the optimizer)."""
        if self.fsdp and not self.lora:
            extra = self._trainer_extra(take=lambda value: value)
            entries = serving_entries(self.model, torch.float32, is_lora=False)
            return self._save(
                Path(path), None, torch.float32, extra, streamed=entries, optimizer=True
            )
        return self._save_state(Path(path), self._checkpoint_state(copy=False))

    def checkpoint_snapshot(self) -> Callable[[str], str] | None:
        """What ``save_checkpoint`` writes, copied now, between two steps; the returned function
        writes the copy to a path later, from any thread, while training goes on (an
        asynchronous checkpoint: the loop waits for the copy, not for the disk). ``None`` for
        a distributed trainer: its gather and barrier are collectives, so it saves in step."""
        if self.distributed:
            return None
        state = self._checkpoint_state(copy=True)
        return lambda path: self._save_state(Path(path), state)

    def _checkpoint_state(self, *, copy: bool) -> dict[str, Any]:
        # ``copy``: tensors detached from the live model and optimizer, which the next step
        # updates in place (a checkpoint written later must hold this step's values).
        take = _copied if copy else (lambda value: value)
        extra = self._trainer_extra(take)
        extra["optimizer"] = take(
            full_optimizer_state(self.model, self.optimizer)
            if self.fsdp
            else optimizer_state_by_name(self.optimizer.state_dict(), self._param_names())
        )
        if self.lora:
            trainable = set(self._param_names())
            adapter = (
                full_model_state(self.model, trainable_only=True)
                if self.fsdp
                else take({k: v for k, v in self.model.state_dict().items() if k in trainable})
            )
            return {"state": None, "adapter": adapter, "extra": extra}
        # (An FSDP2 full fine-tuning checkpoint is streamed instead: save_checkpoint.)
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        return {"state": take(state), "adapter": None, "extra": extra}

    def _trainer_extra(self, take: Callable[[Any], Any]) -> dict[str, Any]:
        # trainer_state.pt: all but the weights and the optimizer.
        return {
            "version": self.version,
            "optimizer": None,  # in optimizer/ (a sharded checkpoint) unless set
            "scheduler": take(self.scheduler.state_dict()),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "python": random.getstate(),
            },
            "config": self.cfg.to_dict(),
        }

    def _save_state(self, path: Path, state: dict[str, Any]) -> str:
        return self._save(
            path, state["state"], torch.float32, extra=state["extra"], adapter=state["adapter"]
        )

    def _param_names(self) -> list[str]:
        # The optimizer's parameters (self.params), in its order.
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def _save(
        self,
        path: Path,
        state: dict[str, torch.Tensor] | None,
        dtype: torch.dtype,
        extra: dict | None,
        adapter: dict[str, torch.Tensor] | None = None,
        *,
        streamed: list[Entry] | None = None,
        optimizer: bool = False,
        role: str = "",
    ) -> str:
        """An HF model folder + tokenizer + ``extra``, written beside ``path`` and swapped in, so
        a crash never leaves a half-written directory. The weights: ``streamed`` (entries
        written by the ranks in turn), else ``state`` (rank 0's), else the LoRA adapter (from
        ``adapter`` when the model is sharded; ``role``: a multi-agent run's one role).
        ``optimizer``: the optimizer's shards too."""
        tmp = path.with_name(path.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if streamed is not None:
            self._barrier()  # the folder exists before any rank writes into it
            if self.fsdp or self.rank == 0:
                writers = self.world_size if self.fsdp else 1
                tensors = lambda keep: stream(self.model, streamed, keep)  # noqa: E731
                write_folder(tmp, streamed, tensors, rank=self.rank, world=writers)
            if optimizer:
                save_sharded_optimizer(self.model, self.optimizer, str(tmp / OPTIMIZER_DIR))
            self._barrier()
        if self.rank == 0:
            if streamed is not None:
                write_config(self.model, tmp, dtype)
            elif state is None:
                lora.save_adapter(self.model, tmp, adapter, role)
            else:
                lora.hf_model(self.model).save_pretrained(tmp, state_dict=state)
                record_dtype(tmp / "config.json", dtype)
            self._save_tokenizer(tmp)
            if extra is not None:
                torch.save(extra, tmp / TRAINER_STATE)
                failpoint("checkpoint.write", self.version)
            old = path.with_name(path.name + ".old")
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        return str(path)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _save_tokenizer(self, directory: Path) -> None:
        # Copy the base model's own tokenizer files when it is local: re-saving would
        # rewrite tokenizer_config.json in this transformers version's format, which
        # an inference server pinned to another version may not read.
        source = Path(self.model_path)
        files = (
            [f for pattern in TOKENIZER_FILES for f in source.glob(pattern)]
            if source.is_dir()
            else []
        )
        if not files:
            self.tokenizer.save_pretrained(directory)
        for f in files:
            shutil.copy2(f, directory / f.name)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a ``save_checkpoint`` directory: the next ``train_step`` continues the run exactly.

        Under FSDP2 each rank reads its own rows of the weights and its shards of a sharded
        optimizer state; what rank 0 alone reads (an adapter, an optimizer state saved whole)
        it broadcasts. Every rank must call it.
        """
        path = Path(path)
        if lora.is_lora_checkpoint(path) and not self.lora:
            raise ValueError(
                f"{path} is a LoRA checkpoint; resume it with the run's lora_rank, "
                "or start a full fine-tuning run from it with init_checkpoint."
            )
        names = self._param_names()
        sharded = (path / OPTIMIZER_DIR).is_dir()  # written by FSDP2 ranks (full fine-tuning)
        if self.fsdp and not self.lora:
            fill_from_files(self.model, path)  # each rank its own rows
            if sharded:
                extra = _read_trainer_state(path)
                load_sharded_optimizer(self.model, self.optimizer, str(path / OPTIMIZER_DIR))
            else:  # saved whole (by one worker): rank 0 reads it and broadcasts the shards
                extra = on_rank0(lambda: _read_trainer_state(path), {})
                by_name = optimizer_state_by_name(extra.pop("optimizer"), names) if extra else {}
                load_full_state(self.model, self.optimizer, None, by_name)
                extra = broadcast_from_rank0(extra)
        elif self.fsdp:
            nothing: tuple[dict[str, torch.Tensor], dict[str, Any]] = ({}, {})
            state, extra = on_rank0(lambda: self._read_adapter_checkpoint(path, names), nothing)
            # A LoRA checkpoint holds the adapter only: the frozen base weights stay.
            optimizer_state = extra.pop("optimizer", {})
            load_full_state(self.model, self.optimizer, state, optimizer_state)
            extra = broadcast_from_rank0(extra)
        else:
            if self.lora:
                lora.load_adapter(self.model, path)
            else:
                self._load_weights(path)
            extra = _read_trainer_state(path)
            if sharded:
                load_sharded_optimizer(self.model, self.optimizer, str(path / OPTIMIZER_DIR))
            else:
                self.optimizer.load_state_dict(optimizer_state_by_index(extra["optimizer"], names))
        self.scheduler.load_state_dict(extra["scheduler"])
        self.version = int(extra["version"])
        torch.set_rng_state(extra["rng"]["torch"])
        if extra["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["rng"]["cuda"])
        random.setstate(_as_random_state(extra["rng"]["python"]))

    def _read_adapter_checkpoint(
        self, path: Path, names: list[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        # Rank 0's part of resuming a sharded LoRA run (a full run's ranks read their own rows).
        state = lora.read_adapter(self.model, path)
        extra = _read_trainer_state(path)
        extra["optimizer"] = optimizer_state_by_name(extra["optimizer"], names)
        return state, extra

    def _load_weights(self, path: Path) -> None:
        state = read_safetensors(path, str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # Tied weights (e.g. lm_head = embed_tokens) are saved once; anything else missing is an error.
        loaded_ptrs = {t.data_ptr() for k, t in self.model.state_dict().items() if k in state}
        untied = [k for k in missing if self.model.state_dict()[k].data_ptr() not in loaded_ptrs]
        if untied or unexpected:
            raise RuntimeError(
                f"checkpoint {path} does not match the model: missing {untied}, unexpected {unexpected}"
            )


def _read_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it cloned (dicts, lists and tuples walked), on the CPU."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()  # (clone is the fast copy on the CPU; .to from a GPU copies)
        return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copied(v) for v in value)
    return value


def _as_random_state(state: Any) -> tuple:
    # random.setstate wants nested tuples; a round trip through torch.save may hand back lists.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
