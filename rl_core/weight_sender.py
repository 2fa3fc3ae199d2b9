"""The trainer's side of the distributed weight update (``rl_core.weight_sync`` drives it).

``PPOTrainer`` delegates here. Rank 0 joins the weight-update group as its rank 0 (it
hosts the rendezvous) and broadcasts each serving tensor in ``weight_metadata`` order;
under FSDP2 every rank takes part in gathering each full tensor (one at a time, so
the extra memory is one unsharded tensor) on the training group, and only rank 0
sends. The weight group is a process group of its own (``rl_core.inference.
weight_group``): the FSDP default group is never touched.

What is sent equals what ``save_weights`` writes (``rl_core.streamed_weights``): the base
model's names and dtype, a LoRA run's adapter merged in, a tensor at a time (its ``A`` and ``B``
gathered with it). A tied output head is not sent: it is the input embedding, which is.

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

from rl_core.failpoints import failpoint
from rl_core.inference.weight_group import WeightGroup, dtype_name
from rl_core.streamed_weights import serving_entries, stream

logger = logging.getLogger(__name__)


def weight_metadata(trainer: Any) -> dict[str, list]:
    """``{"names", "dtypes", "shapes"}`` of the serving tensors, in sending order (no collective)."""
    entries = serving_entries(trainer.model, trainer.save_dtype, is_lora=trainer.lora)
    return {
        "names": [e.name for e in entries],
        "dtypes": [dtype_name(e.dtype) for e in entries],
        "shapes": [list(e.shape) for e in entries],
    }


def _serving_tensors(trainer: Any) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Each serving tensor in metadata order; ``None`` on ranks other than 0 (they only gather)."""
    entries = serving_entries(trainer.model, trainer.save_dtype, is_lora=trainer.lora)
    for entry, tensor in stream(trainer.model, entries, lambda _: trainer.rank == 0):
        yield entry.name, tensor


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
