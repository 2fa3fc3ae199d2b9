"""A model's weights one tensor at a time: gathered from FSDP2 shards one by one, written into
safetensors files by the ranks in turn. Never the whole model on one rank.

What inference servers load (``save_weights``, the broadcast in ``rl_core.weight_sender``), a
sharded trainer's checkpoint weights, and the export of a checkpoint all go through here:

- ``serving_entries``: the tensors' names (the base model's own), shapes and dtypes, in order,
  without a collective; a tied output head is left out (it is the input embedding).
- ``stream``: each tensor in that order. Under FSDP2 every rank joins each tensor's all-gather
  (one DTensor's full tensor at a time); a LoRA run's adapted weights come merged,
  ``W + scale · B @ A`` in float32 from the gathered ``A`` and ``B``. Only the ranks that
  ``keep(i)`` says get the tensor (cast); the others get ``None``.
- ``write_folder``: the stream written as ``model-0000k-of-0000n.safetensors`` files of at most
  ``max_file_bytes`` each (default ``FILE_BYTES``; plus ``model.safetensors.index.json``; one file is
  ``model.safetensors``), file ``k`` written by rank ``k mod world``: a rank holds at most one
  file's tensors, and the ranks write in parallel. Loadable by ``from_pretrained``, SGLang,
  vLLM and ``rl_core.sharded_load``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_core import lora
from rl_core.hf import record_dtype

FILE_BYTES = 1 << 30  # a safetensors file of the written weights: at most 1 GiB (or one tensor)
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    """One tensor of the written weights: its name in the files and its state-dict key(s)."""

    name: str
    key: str  # in the model's state dict (peft's names for a LoRA run)
    shape: tuple[int, ...]
    dtype: torch.dtype  # as written
    lora_a: str | None = None  # the adapter's state-dict keys when the weight is adapted
    lora_b: str | None = None
    scale: float = 0.0
    transposed: bool = False  # GPT-2's Conv1D stores W as [in, out]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def serving_entries(model: Any, dtype: torch.dtype, *, is_lora: bool) -> list[Entry]:
    """The weights as written, in state-dict order (no collective). Floating-point tensors are
    cast to ``dtype``; the frozen base of a LoRA run is named as the base model names it."""
    adapted = _adapted(model) if is_lora else {}
    config = lora.hf_model(model).config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    entries = []
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        name = lora.base_key(key)
        if tied and name == "lm_head.weight":
            continue
        cast = dtype if value.is_floating_point() else value.dtype
        extra = adapted.get(name, {})
        entries.append(Entry(name, key, tuple(value.shape), cast, **extra))
    return entries


def _adapted(model: Any) -> dict[str, dict[str, Any]]:
    """Base weight name -> its adapter's keys and scale, for each LoRA layer (one adapter)."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        (adapter,) = layer.active_adapters
        base = name.removeprefix(lora.PEFT_PREFIX)
        found[f"{base}.weight"] = {
            "lora_a": f"{name}.lora_A.{adapter}.weight",
            "lora_b": f"{name}.lora_B.{adapter}.weight",
            "scale": float(layer.scaling[adapter]),
            "transposed": bool(getattr(layer, "fan_in_fan_out", False)),
        }
    return found


def _full(value: torch.Tensor) -> torch.Tensor:
    # An FSDP2 shard: every rank joins its all-gather.
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def stream(
    model: Any, entries: list[Entry], keep: Callable[[int], bool]
) -> Iterator[tuple[Entry, torch.Tensor | None]]:
    """Each entry's full tensor (cast, on the model's device) where ``keep(i)``, else ``None``.
    Every rank of a sharded model must run it to the end (each tensor is a collective)."""
    state = model.state_dict()  # DTensors under FSDP2: nothing gathered yet
    with torch.no_grad():
        for i, entry in enumerate(entries):
            value = _full(state[entry.key]).detach()
            delta = None
            if entry.lora_a is not None and entry.lora_b is not None:
                a = _full(state[entry.lora_a]).float()  # [r, in]
                b = _full(state[entry.lora_b]).float()  # [out, r]
                delta = entry.scale * (b @ a)
                if entry.transposed:
                    delta = delta.T
            if not keep(i):
                yield entry, None
                continue
            if delta is not None:
                value = value.float() + delta
            yield entry, value.to(entry.dtype)


def file_plan(entries: list[Entry], max_file_bytes: int) -> list[int]:
    """The file each entry goes into: consecutive entries, at most ``max_file_bytes`` a file."""
    files, size, current = [], 0, 0
    for entry in entries:
        if size and size + entry.nbytes > max_file_bytes:
            current, size = current + 1, 0
        files.append(current)
        size += entry.nbytes
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def write_folder(
    directory: Path,
    entries: list[Entry],
    tensors: Callable[[Callable[[int], bool]], Iterable[tuple[Entry, torch.Tensor | None]]],
    *,
    rank: int = 0,
    world: int = 1,
    max_file_bytes: int | None = None,
) -> None:
    """Write ``tensors(keep)`` (e.g. ``lambda keep: stream(model, entries, keep)``) into
    ``directory`` (which must exist): each rank its own files, rank 0 the index. Every rank
    calls it; no barrier at the end (the caller's)."""
    from safetensors.torch import save_file

    plan = file_plan(entries, max_file_bytes or FILE_BYTES)
    count = plan[-1] + 1 if plan else 0
    names = file_names(count)
    last = {f: i for i, f in enumerate(plan)}  # each file's last entry
    mine: dict[str, torch.Tensor] = {}
    for i, (entry, tensor) in enumerate(tensors(lambda i: plan[i] % world == rank)):
        if tensor is None:
            continue
        mine[entry.name] = tensor.detach().to("cpu").contiguous()
        if last[plan[i]] == i:
            save_file(mine, str(directory / names[plan[i]]), metadata={"format": "pt"})
            mine = {}
    if rank == 0 and count > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: names[f] for e, f in zip(entries, plan, strict=True)},
        }
        (directory / INDEX).write_text(json.dumps(index, indent=2))


def write_config(model: Any, directory: Path, dtype: torch.dtype) -> None:
    """The base model's ``config.json`` (its dtype the written tensors') and generation config,
    as ``save_pretrained`` writes them."""
    hf = lora.hf_model(model)
    config = copy.deepcopy(hf.config)
    config.architectures = [type(hf).__name__]
    config.save_pretrained(directory)
    record_dtype(directory / "config.json", dtype)
    generation = getattr(hf, "generation_config", None)
    if generation is not None and hf.can_generate():
        generation.save_pretrained(directory)
