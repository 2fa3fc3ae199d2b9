"""Steep's weight broadcast as a vLLM weight-transfer engine, ``steep``: runs inside vLLM.

vLLM 0.32 takes new weights without a restart through its weight-transfer routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``), each handed to a pluggable engine in every worker. Its own
``nccl`` engine needs the trainer to speak vLLM's PyNccl protocol (vLLM in the trainer's
process) and GPUs. This one speaks Steep's, SGLang's: each worker joins the trainer's weight
group (``rl_core.inference.weight_group``, the one the torch engine joins: gloo on CPUs, NCCL
on GPUs) as rank ``rank_offset`` + its rank in the server, and each update is one broadcast
from rank 0 per tensor, in the order of the posted names. So the same trainer and
``WeightSync`` push into SGLang, the torch engine and vLLM, and CI runs the path for real on
CPUs over gloo. Received tensors load through vLLM's layerwise reload
(``initialize_layerwise_reload`` at start, ``model.load_weights`` per tensor,
``finalize_layerwise_reload`` at finish), as its ``nccl`` engine does.

vLLM loads it as a general plugin (``register``, named by the entry point in
``deploy/vllm-plugin/steep_vllm-0.dist-info``, which ``VLLMServer`` puts on the server's
``PYTHONPATH`` with Steep's root) and the launch selects it with
``--weight-transfer-config '{"backend": "steep"}'``. Only vLLM's processes import this module
(it imports vllm); Steep's own never do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rl_core.inference.weight_group import DEFAULT_GROUP_NAME, WeightGroup, parse_dtype

BACKEND = "steep"


def register() -> None:
    """vLLM's general-plugin hook (called in every vLLM process, maybe more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, SteepWeightTransferEngine)


@dataclass
class SteepInitInfo(WeightTransferInitInfo):
    """SGLang's ``/init_weights_update_group`` fields."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"
    timeout_s: float = 60.0


@dataclass
class SteepUpdateInfo(WeightTransferUpdateInfo):
    """SGLang's ``/update_weights_from_distributed`` fields: the tensors, in broadcast order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)}"
            )


class SteepWeightTransferEngine(WeightTransferEngine[SteepInitInfo, SteepUpdateInfo]):
    """One vLLM worker's member of Steep's weight group."""

    init_info_cls = SteepInitInfo
    update_info_cls = SteepUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: WeightGroup | None = None

    def init_transfer_engine(self, init_info: SteepInitInfo) -> None:
        self.shutdown()  # a trainer's new group replaces an old one
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = WeightGroup(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank=init_info.rank_offset + worker,
            world_size=init_info.world_size,
            group_name=init_info.group_name,
            backend=init_info.backend,
            timeout_s=init_info.timeout_s,
            device=self.device,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":  # a broadcast on a GPU stream may still be running
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SteepUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("no weight group: POST /init_weight_transfer_engine first")
        for name, dtype, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=parse_dtype(dtype), device=self.device)
            self.group.broadcast(tensor)
            self.model.load_weights([(name, tensor)])

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
