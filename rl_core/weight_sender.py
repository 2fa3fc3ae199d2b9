"""The trainer's side of the distributed weight update (``rl_core.weight_sync`` drives it).

``PPOTrainer`` delegates here. Rank 0 joins the weight-update group as its rank 0 (it
hosts the rendezvous) and broadcasts each serving tensor in ``weight_metadata`` order;
under FSDP2 every rank takes part in gathering each full tensor (one at a time, so
the extra memory is one unsharded tensor) on the training group, and only rank 0
sends. The weight group is a process group of its own (``rl_core.inference.
weight_group``): the FSDP default group is never touched.

What is sent equals what ``save_weights`` writes: the base model's names and dtype, a
LoRA run's adapter merged in (gathered onto rank 0 first under FSDP2). A tied output
head is not sent: it is the input embedding, which is.

A broadcast that fails or times out does not raise on rank 0 in the middle of the
gathers (the other ranks would wait in a collective forever): rank 0 stops sending,
keeps gathering to the end and then reports the error, and drops the group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from rl_core import lora
from rl_core.distributed import full_model_state
from rl_core.failpoints import failpoint
from rl_core.inference.weight_group import WeightGroup, dtype_name

logger = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."


def _serving_name(name: str, is_lora: bool) -> str | None:
    if not is_lora:
        return name
    if ".lora_" in name:
        return None
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def _skip_tied(trainer: Any, name: str) -> bool:
    config = lora.hf_model(trainer.model).config
    return bool(getattr(config, "tie_word_embeddings", False)) and name == "lm_head.weight"


def weight_metadata(trainer: Any) -> dict[str, list]:
    """``{"names", "dtypes", "shapes"}`` of the serving tensors, in sending order (no collective)."""
    names, dtypes, shapes = [], [], []
    for key, value in trainer.model.state_dict().items():
        name = _serving_name(key, trainer.lora)
        if name is None or _skip_tied(trainer, name):
            continue
        dtype = trainer.save_dtype if value.is_floating_point() else value.dtype
        names.append(name)
        dtypes.append(dtype_name(dtype))
        shapes.append(list(value.shape))  # a DTensor's shape is the global one
    return {"names": names, "dtypes": dtypes, "shapes": shapes}


def _serving_tensors(trainer: Any) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Each serving tensor in metadata order; ``None`` on ranks other than 0 (they only gather)."""
    if trainer.lora:
        full = full_model_state(trainer.model) if trainer.fsdp else None
        merged = lora.merged_state_dict(trainer.model, trainer.save_dtype, full)
        for name in weight_metadata(trainer)["names"]:
            yield name, merged.get(name) if trainer.rank == 0 else None
        return
    for key, value in trainer.model.state_dict().items():
        if _skip_tied(trainer, key):
            continue
        if hasattr(value, "full_tensor"):  # an FSDP2 shard: every rank joins the all-gather
            value = value.full_tensor()
        if trainer.rank != 0:
            yield key, None
            continue
        dtype = trainer.save_dtype if value.is_floating_point() else value.dtype
        yield key, value.detach().to(dtype)


class WeightSender:
    """Rank 0's membership of the weight-update groups, by name."""

    def __init__(self) -> None:
        self.groups: dict[str, WeightGroup] = {}

    def init_group(
        self,
        trainer: Any,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Join (and host) the group as its rank 0; other trainer ranks do nothing. Blocks
        until every server joined, at most ``timeout_s``."""
        if trainer.rank != 0:
            return
        self.destroy(group_name)
        device = trainer.device if backend == "nccl" else torch.device("cpu")
        self.groups[group_name] = WeightGroup(
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
            device=device,
        )

    def broadcast(self, trainer: Any, group_name: str) -> dict[str, Any]:
        """Send every serving tensor; every trainer rank calls it. Rank 0's result:
        ``{"ok", "bytes", "seconds", "error"}``; a failure drops the group."""
        started = time.perf_counter()
        group = self.groups.get(group_name) if trainer.rank == 0 else None
        error = None if group is not None or trainer.rank != 0 else f"no group {group_name!r}"
        sent = 0
        for name, tensor in _serving_tensors(trainer):
            if tensor is None or group is None or error is not None:
                continue  # keep iterating: the other ranks' gathers need this rank
            try:
                tensor = tensor.to(group.device).contiguous()
                group.broadcast(tensor)
                sent += tensor.numel() * tensor.element_size()
                failpoint("weight_sync.broadcast", int(trainer.version))
            except Exception as exc:
                error = f"{name}: {exc}"
                logger.warning("weight broadcast failed at %s", error)
        if error is not None:
            self.destroy(group_name)
        return {
            "ok": error is None,
            "bytes": sent,
            "seconds": time.perf_counter() - started,
            "error": error,
        }

    def destroy(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is not None:
            group.close()
