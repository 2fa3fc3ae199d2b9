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

Members on several nodes: gloo binds each member to one local address and publishes it
in the store for the others to connect to. By default torch takes the address its
hostname resolves to, which on many hosts is a loopback one (``127.0.1.1``) that no
other node can reach; so each member binds the address its node uses on the route to
``master_address`` (rank 0's node IP) instead, unless ``GLOO_SOCKET_IFNAME`` names the
interfaces to use (as for torch's own groups).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
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


def local_address_towards(host: str) -> str:
    """This node's address on the route to ``host`` ("" when there is none to find).

    A UDP ``connect`` only picks the route; nothing is sent."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return ""


def _gloo_options(master_address: str, timeout: datetime.timedelta) -> Any:
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if interfaces:
        devices = [dist.ProcessGroupGloo.create_device(interface=i) for i in interfaces]
    else:  # an empty hostname: torch's default (the hostname's address)
        devices = [
            dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))
        ]
    options._devices = devices
    options._threads = 2 * len(devices)
    return options


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
            # A member registers as a worker (TCPStore's wait_for_workers on a client adds
            # itself to the count and returns): a master made by torch.distributed.rendezvous,
            # as SGLang's init_custom_process_group makes it, waits for every member to
            # register and would otherwise wait out its timeout. Steep's own rank 0 does not
            # wait, since it asks the servers to join only after its store is up.
            self._store: Any = dist.TCPStore(
                master_address,
                int(master_port),
                world_size,
                is_master=rank == 0,
                timeout=self.timeout,
                wait_for_workers=rank != 0,
            )
            # The key layout of SGLang's init_custom_process_group: the group name, then
            # what torch's _new_process_group_helper adds (group name, device).
            store = dist.PrefixStore(group_name, self._store)
            store = dist.PrefixStore(f"{group_name}/", store)
            store = dist.PrefixStore(f"{self.device.type}/", store)
            self._pg: Any = self._make_pg(store, master_address)
        except Exception as exc:
            raise WeightGroupError(
                f"could not join weight group {group_name!r} at {master_address}:{master_port} "
                f"as rank {rank} of {world_size}: {exc}"
            ) from exc

    def _make_pg(self, store: Any, master_address: str) -> Any:
        if self.backend == "gloo":
            options = _gloo_options(master_address, self.timeout)
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, options)
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
