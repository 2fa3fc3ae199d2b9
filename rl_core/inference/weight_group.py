"""The weight-update process group: trainer rank 0 broadcasts, every inference server receives.

SGLang's ``/init_weights_update_group`` protocol: the trainer is rank 0 and hosts the
rendezvous (a ``TCPStore`` at ``master_address:master_port``); server ``i`` joins as rank
``rank_offset + tp_rank`` of ``world_size``. Each update is one broadcast from rank 0 per
tensor, in the order of the ``names`` posted to ``/update_weights_from_distributed``.

The group is built directly as a ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) over its
own store, so it never touches the process's default group: a trainer under FSDP keeps
its ``torch.distributed`` group, and neither side calls ``init_process_group``. Every
operation is bounded by ``timeout_s``: a peer that dies or never comes is an error after
at most that long (gloo notices a closed connection at once), never a hang.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default


class WeightGroupError(RuntimeError):
    """Joining the group or a broadcast failed or timed out."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how SGLang's clients name dtypes on the wire."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


class WeightGroup:
    """One member of a weight-update group (rank 0 sends, the others receive)."""

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        device: torch.device | str = "cpu",
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        try:
            # Rank 0 serves the rendezvous; the others connect (and wait up to the timeout).
            self._store: Any = dist.TCPStore(
                master_address,
                int(master_port),
                world_size,
                is_master=rank == 0,
                timeout=self.timeout,
                wait_for_workers=False,
            )
            # The key layout of SGLang's init_custom_process_group: the group name, then
            # what torch's _new_process_group_helper adds (group name, device).
            store = dist.PrefixStore(group_name, self._store)
            store = dist.PrefixStore(f"{group_name}/", store)
            store = dist.PrefixStore(f"{self.device.type}/", store)
            self._pg: Any = self._make_pg(store)
        except Exception as exc:
            raise WeightGroupError(
                f"could not join weight group {group_name!r} at {master_address}:{master_port} "
                f"as rank {rank} of {world_size}: {exc}"
            ) from exc

    def _make_pg(self, store: Any) -> Any:
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
        raise ValueError(f"weight group backend {self.backend!r}: use 'gloo' or 'nccl'")

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 into every member's ``tensor`` (in place)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        try:
            work = self._pg.broadcast([tensor], opts)
            work.wait(self.timeout)
        except Exception as exc:
            raise WeightGroupError(
                f"broadcast in weight group {self.group_name!r} (rank {self.rank}) failed: {exc}"
            ) from exc

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # a broken group may refuse a clean shutdown; drop it anyway
                logger.debug("weight group shutdown failed", exc_info=True)
        self._store = None
