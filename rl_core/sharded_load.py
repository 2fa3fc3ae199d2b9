"""Loading a model straight into FSDP2 shards: no rank ever holds the whole model.

What ``train_workers > 1`` trainers (and their KL reference model) load with, instead of
building the full float32 model on every rank and sharding it afterwards (a 32B model would
be 128 GB per rank before ``fully_shard`` ran):

1. The model is built with its parameters on the meta device (shapes, no storage) and its
   buffers real (rotary frequencies are computed at construction and saved nowhere).
   A LoRA run's adapter is created for real, by peft, exactly as the unsharded path creates
   it (same random initialisation for the same seed): it is small.
2. ``fully_shard`` shards the meta parameters (``rl_core.distributed.shard_model``), then
   ``to_empty`` gives each rank storage for its own shards only.
3. Each rank reads its own rows of each parameter from the ``*.safetensors`` files
   (``safe_open(...).get_slice``: the file is memory-mapped and only those rows are read),
   a parameter at a time, converted to the parameter's dtype. The buffers and the adapter
   are put back.

So a rank's memory is its shards plus one parameter's rows, and the host's page cache holds
the files once per node, whatever the number of ranks. Works for a model directory, a full
checkpoint, a LoRA checkpoint (its base weights streamed, its adapter loaded; a full
fine-tuning run gets ``W + scale · B @ A`` row by row) and the reference model. A model whose
files are not safetensors, or whose keys are not the model's own (a conversion
transformers does on loading), is loaded the unsharded way with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rl_core import lora
from rl_core.config import RunConfig
from rl_core.distributed import parameter_names, shard_model

logger = logging.getLogger(__name__)


def load_sharded(
    path: str | os.PathLike,
    cfg: RunConfig,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None = None,
    *,
    param_dtype: torch.dtype | None = None,
    prepare: Callable[[Any], None] | None = None,
    mesh: Any = None,
    offload: bool = False,
) -> Any:
    """The model ``lora.load_policy`` would return, sharded with FSDP2 over ``mesh`` (default:
    every rank) with parameters in ``dtype`` on ``device``, built without ever holding it whole.

    ``prepare(model)`` runs before sharding (train/eval mode, activation checkpointing,
    freezing). ``param_dtype``: the compute dtype ``shard_model`` casts to; ``offload``: its
    CPU offload (the shards then live in CPU memory). Every rank calls it.
    """
    base = lora.base_weights_path(path)
    files = _tensor_files(base)
    model: Any = build_on_meta(base, dtype, attn_implementation) if files else None
    unknown = _unknown_keys(model, files) if model is not None else ["(no *.safetensors files)"]
    if unknown:
        logger.warning(
            "Loading %s whole on every rank before sharding: its weights cannot be streamed "
            "into shards (keys not found in its safetensors files: %s).",
            base,
            unknown[:5],
        )
        model = lora.load_policy(path, cfg, dtype, device, attn_implementation)
        if prepare is not None:
            prepare(model)
        shard_model(model, param_dtype=param_dtype, mesh=mesh, offload=offload)
        return model

    model, adapter = sharded_skeleton(
        model, path, cfg, device, param_dtype=param_dtype, prepare=prepare, mesh=mesh,
        offload=offload,
    )  # fmt: skip
    full_from_lora = not cfg.lora_rank and lora.is_lora_checkpoint(path)
    deltas = AdapterDeltas(Path(path)) if full_from_lora else None  # merged weights
    with torch.no_grad():
        _fill(model, files, adapter, deltas)
    return model


def sharded_skeleton(
    model: Any,
    path: str | os.PathLike,
    cfg: RunConfig,
    device: torch.device,
    *,
    param_dtype: torch.dtype | None = None,
    prepare: Callable[[Any], None] | None = None,
    mesh: Any = None,
    offload: bool = False,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Steps 1-2 on ``model`` (``build_on_meta``'s): the adapter when the run has one, sharded,
    storage for this rank's shards (uninitialised) and its buffers back. Returns the model and
    the adapter's full values (to fill its shards with)."""
    if cfg.lora_rank:
        model = _with_adapter(model, lora.base_weights_path(path), cfg)
    adapter = _adapter_values(model, path) if cfg.lora_rank else {}
    if prepare is not None:
        prepare(model)
    shard_model(model, param_dtype=param_dtype, mesh=mesh, offload=offload)
    # Buffers as fully_shard placed them (on the device); to_empty would leave them garbage.
    buffers = [
        (module, name, b.detach().clone())
        for module in model.modules()
        for name, b in module._buffers.items()
        if b is not None
    ]
    model.to_empty(device=torch.device("cpu") if offload else device)
    for module, name, value in buffers:
        module._buffers[name] = value
    return model, adapter


def fill_from_files(model: Any, path: str | os.PathLike) -> None:
    """Each rank's shards of ``model`` (sharded by FSDP2) read from the safetensors files in
    ``path`` (a full checkpoint or model directory), its own rows only."""
    files = _tensor_files(str(path))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in checkpoint {path}")
    if unknown := _unknown_keys(model, files):
        raise ValueError(f"{path} lacks weights of this model: {unknown[:5]}")
    with torch.no_grad():
        _fill(model, files, {}, None)


def _tensor_files(base: str) -> dict[str, str]:
    """Tensor key -> the safetensors file holding it, for the model directory ``base``."""
    from safetensors import safe_open

    folder = Path(base)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    where: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), str(f)))
    return where


def build_on_meta(base: str, dtype: torch.dtype, attn_implementation: str | None) -> Any:
    """The model of ``base``'s config, its parameters on the meta device, its buffers real."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_core.hf import dtype_kwargs

    config = AutoConfig.from_pretrained(base)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(dtype), **extra)
    for module in model.modules():  # as rl_core.hf.load_causal_lm
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (its initialisation is then
    free); buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    setattr(torch.nn.Module, "register_parameter", on_meta)  # noqa: B010
    try:
        yield
    finally:
        setattr(torch.nn.Module, "register_parameter", register)  # noqa: B010


def _unknown_keys(model: Any, files: dict[str, str]) -> list[str]:
    return sorted(
        names[0]
        for names in parameter_names(model).values()
        if not any(lora.base_key(n) in files for n in names)
    )


def _with_adapter(model: Any, base: str, cfg: RunConfig) -> Any:
    """peft's adapter around the meta model, initialised as ``lora.load_policy`` does.

    peft moves a new adapter to its base layer's device: while it runs, the base weights are
    stand-ins on the CPU with one element of storage each, so the adapter stays real.
    """
    stand_ins: dict[int, torch.nn.Parameter] = {}
    originals: dict[int, torch.nn.Parameter] = {}
    slots = []
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is None or not p.is_meta:
                continue
            if id(p) not in stand_ins:  # tied weights share one stand-in
                zero = torch.zeros((), dtype=p.dtype).expand(p.shape)
                stand_ins[id(p)] = torch.nn.Parameter(zero, requires_grad=p.requires_grad)
                originals[id(stand_ins[id(p)])] = p
            module._parameters[key] = stand_ins[id(p)]
            slots.append((module, key))
    model = lora.with_adapters(model, cfg, base)  # (a multi-agent run: one per role)
    for module, key in slots:
        stand_in = module._parameters[key]
        original = originals[id(stand_in)]
        original.requires_grad_(stand_in.requires_grad)  # peft froze the base
        module._parameters[key] = original
    return model


def _adapter_values(model: Any, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapter's full values by parameter name: a LoRA checkpoint's, or peft's fresh ones."""
    if lora.is_lora_checkpoint(path):
        return lora.read_adapter(model, path)
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


class AdapterDeltas:
    """``scale · B @ A`` of a LoRA checkpoint for each weight it adapts, a rows slice at a time."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        config = json.loads((path / lora.ADAPTER_CONFIG).read_text())
        rank = config["r"]
        root = math.sqrt(rank) if config.get("use_rslora") else rank
        self.scale = config["lora_alpha"] / root
        self.fan_in_fan_out = bool(config.get("fan_in_fan_out"))
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        saved = load_file(str(path / lora.ADAPTER_WEIGHTS))
        for key, a in saved.items():
            if ".lora_A." in key:
                module = key.removeprefix(lora.PEFT_PREFIX).split(".lora_A.")[0]
                b = saved[key.replace(".lora_A.", ".lora_B.")]
                self.pairs[f"{module}.weight"] = (a.float(), b.float())

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        if key not in self.pairs:
            return None
        a, b = self.pairs[key]  # [r, in], [out, r]
        if self.fan_in_fan_out:  # the weight is stored [in, out]
            return self.scale * (b @ a[:, start:stop]).T
        return self.scale * (b[start:stop] @ a)


def _rows(param: Any) -> tuple[int, int, int]:
    """The rows ``[start, stop)`` of dim 0 this rank holds of the sharded ``param``, and its
    local length (FSDP2's ``Shard(0)``: ``ceil(n / world)`` rows a rank, the last ones short)."""
    from torch.distributed.tensor import Shard

    (placement,) = param.placements
    if not (isinstance(placement, Shard) and placement.dim == 0):
        raise ValueError(f"expected FSDP2's Shard(0) placement, got {param.placements}")
    mesh = param.device_mesh
    n = param.shape[0]
    chunk = math.ceil(n / mesh.size()) if n else 0
    start = min(n, chunk * mesh.get_local_rank())
    stop = min(n, start + chunk)
    return start, stop, param.to_local().shape[0]


def _fill(
    model: Any,
    files: dict[str, str],
    adapter: dict[str, torch.Tensor],
    deltas: AdapterDeltas | None,
) -> None:
    """Every parameter's local shard from its source: the adapter's values, or its rows read
    from the files (plus a LoRA checkpoint's delta when merging)."""
    from safetensors import safe_open

    for names in parameter_names(model).values():
        param = model.get_parameter(names[0])
        local = param.to_local()
        start, stop, length = _rows(param)
        if length != stop - start:
            raise RuntimeError(f"{names[0]}: local shard of {length} rows, not {stop - start}")
        if stop == start:
            continue
        if names[0] in adapter:
            local.copy_(adapter[names[0]][start:stop])
            continue
        key = next(lora.base_key(n) for n in names if lora.base_key(n) in files)
        # Opened for each parameter: the file is memory-mapped, and the pages read stay in
        # this process's resident memory until it is closed.
        with safe_open(files[key], framework="pt") as handle:
            rows = handle.get_slice(key)[start:stop]
        delta = deltas.rows(key, start, stop) if deltas is not None else None
        if delta is not None:
            rows = rows.float() + delta
        local.copy_(rows.to(local.dtype))
