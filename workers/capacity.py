"""What a run asks of its Ray cluster, checked before anything starts.

A run needs ``train_workers`` trainer processes and ``num_inference_servers`` inference
servers (none when it attaches to a shared pool, whose servers are the pool's). On a cluster
with GPUs each trainer worker takes one GPU, and each SGLang or vLLM server takes
``inference_tensor_parallel`` GPUs (the torch engine takes a CPU); on a CPU-only cluster each
takes one CPU (vLLM's CPU build, too).
``check_capacity`` compares that with the cluster's totals (``ray.cluster_resources()``)
and refuses a run that could never be placed, naming the numbers; a run that fits the
totals but not what is free now waits, ``queued``, with ``wait_reason`` saying for what
(the worker counts what active runs and pools hold before it submits the job), and once
submitted waits for its placement group up to ``placement_timeout_s()`` instead of hanging.

Pure functions of the config and the resources dict: no Ray, no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rl_core.config import RunConfig

PLACEMENT_TIMEOUT_ENV = "STEEP_PLACEMENT_TIMEOUT_S"
DEFAULT_PLACEMENT_TIMEOUT_S = 600.0


class CapacityError(RuntimeError):
    """The cluster cannot hold the run's trainer workers and inference servers."""


def placement_timeout_s() -> float:
    """How long trainer workers wait for their GPUs/CPUs (``STEEP_PLACEMENT_TIMEOUT_S``)."""
    raw = os.environ.get(PLACEMENT_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_PLACEMENT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{PLACEMENT_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{PLACEMENT_TIMEOUT_ENV}={raw!r} must be above 0")
    return value


def has_gpus(resources: Mapping[str, float]) -> bool:
    return float(resources.get("GPU", 0)) > 0


def resolve_backend(requested: str, resources: Mapping[str, float]) -> str:
    """The inference backend for this cluster: ``auto`` is SGLang when the cluster has GPUs
    (its GPU nodes run Steep's GPU image), else the torch engine.

    Decided from the cluster, not from the node the job's driver happens to run on: the
    driver needs no GPU since the trainer runs in its own actors.
    """
    if requested == "auto":
        return "sglang" if has_gpus(resources) else "torch"
    if requested == "sglang" and not has_gpus(resources):
        raise CapacityError(
            "inference_backend is 'sglang' but the Ray cluster has no GPUs; "
            "set inference_backend to 'torch', 'vllm' (its CPU build) or 'auto', or add GPU nodes."
        )
    return requested


def server_gpus(backend: str, resources: Mapping[str, float], tensor_parallel: int = 1) -> int:
    """The GPUs one inference server takes: ``tensor_parallel`` for SGLang, and for vLLM on a
    cluster with GPUs (its CUDA build); none for the torch engine or vLLM's CPU build."""
    on_gpus = backend == "sglang" or (backend == "vllm" and has_gpus(resources))
    return tensor_parallel if on_gpus else 0


@dataclass(frozen=True)
class Needs:
    """One run's resources: the kind (``GPU`` or ``CPU``), each trainer worker's and in all."""

    kind: str
    total: float
    trainer_bundle: dict[str, float]
    server_resources: dict[str, float]


def own_servers(config: RunConfig) -> int:
    """Inference servers the run starts: none when it attaches to a shared pool."""
    return 0 if config.inference_pool else config.num_inference_servers


def run_needs(config: RunConfig, backend: str, resources: Mapping[str, float]) -> Needs:
    gpus = has_gpus(resources)
    trainer_bundle = {"CPU": 1.0, "GPU": 1.0} if gpus else {"CPU": 1.0}
    server = server_resources(backend, resources, config.inference_tensor_parallel)
    kind = "GPU" if gpus else "CPU"
    total = config.train_workers * trainer_bundle.get(kind, 0) + (
        own_servers(config) * server.get(kind, 0)
    )
    return Needs(kind, total, trainer_bundle, server)


def check_capacity(config: RunConfig, backend: str, resources: Mapping[str, float]) -> Needs:
    """The run's needs; ``CapacityError`` naming the numbers when the cluster is too small."""
    tp = config.inference_tensor_parallel
    if tp > 1 and not server_gpus(backend, resources, tp):
        raise CapacityError(
            f"inference_tensor_parallel={tp} splits each inference server over {tp} GPUs, and "
            f"the {backend} servers of this cluster run on CPUs; set it to 1, or add GPU nodes."
        )
    needs = run_needs(config, backend, resources)
    have = float(resources.get(needs.kind, 0))
    if needs.total > have:
        servers = own_servers(config)
        what = {"sglang": "SGLang server", "vllm": "vLLM server"}.get(
            backend, "torch-engine inference server"
        ) + ("s" if servers != 1 else "")
        if tp > 1:
            what += f" of {tp} GPUs each"
        raise CapacityError(
            f"train_workers={config.train_workers} and {servers} {what} "
            f"need {needs.total:g} {needs.kind}s; the cluster has {have:g}. "
            "Lower train_workers or num_inference_servers, or add nodes to the Ray cluster."
        )
    return needs


def server_resources(
    backend: str, resources: Mapping[str, float], tensor_parallel: int = 1
) -> dict[str, float]:
    """One inference server's bundle: a CPU, and its GPUs (``server_gpus``)."""
    gpus = server_gpus(backend, resources, tensor_parallel)
    return {"CPU": 1.0, "GPU": float(gpus)} if gpus else {"CPU": 1.0}


def _amount(value: float, kind: str) -> str:
    return f"{value:g} {kind}{'s' if value != 1 else ''}"


def wait_reason(
    config: RunConfig, backend: str, resources: Mapping[str, float], held: Mapping[str, float]
) -> str:
    """Why the run cannot start now, or ``""`` when it fits what ``held`` leaves free.

    ``resources`` are the cluster's totals; ``held`` what each active holder (``"pool x"``,
    ``"run 'y'"``) takes of the run's resource kind. A run that exceeds the totals is not
    kept waiting (nothing will ever free enough): ``check_capacity`` refuses it with the numbers.
    """
    needs = run_needs(config, backend, resources)
    have = float(resources.get(needs.kind, 0))
    free = max(have - sum(held.values()), 0.0)
    if needs.total <= free or needs.total > have:
        return ""
    servers = own_servers(config)
    what = "the trainer" + (
        f" and {servers} inference server{'s' if servers != 1 else ''}" if servers else ""
    )
    holders = ", ".join(
        f"{name} {'hold' if name.endswith(' runs') else 'holds'} {amount:g}"
        for name, amount in held.items()
        if amount
    )
    return (
        f"waiting for {_amount(needs.total, needs.kind)} for {what}: {free:g} of {have:g} free"
        + (f"; {holders}" if holders else "")
    )
