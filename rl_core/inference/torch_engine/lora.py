"""LoRA adapters in the torch engine: SGLang's multi-LoRA serving on one shared base model.

An adapter is a peft directory (``adapter_config.json`` + ``adapter_model.safetensors``)
loaded into memory under a name (``/load_lora_adapter``); a ``/generate`` request names
the adapter it runs under (``lora_path``) or none (the base model). The base weights are
never merged: every target ``nn.Linear`` of the served model carries a forward hook that
adds ``scale · B(A(x))`` of each batch row's own adapter to the base output. When rows run
under different adapters (or the base model), the adapters present are stacked along the
rank (``[A1; A2; ...]``, ``[s1·B1, s2·B2, ...]``), and a per-row mask keeps each row's own
block: two matmuls per module, however many adapters share the batch (one matmul pair per
adapter cost a Python round of ops per adapter and module, most of a mixed decode step on
a CPU). So requests under different adapters and the base model share one running batch and
one KV cache.

Unloading follows SGLang's registry: the name disappears at once (new requests naming it
are refused with 400), and the answer comes once the requests still running under it
have finished; they are never aborted.

Names and values of the launch flags are SGLang's: ``--enable-lora``, ``--max-lora-rank``,
``--lora-target-modules`` (module names, or ``all``), ``--max-loras-per-batch`` (the most
distinct adapters in one running batch; the base model is not counted; requests beyond
wait in the queue), ``--max-loaded-loras`` (the most adapters held in memory).

Eviction (Steep's, for shared pools; SGLang refuses a load past ``--max-loaded-loras``):
when an adapter must load and the limit is reached, the least recently used *idle* one
(no request under it, not ``pinned``) is dropped from memory but its name and path are
kept; a ``/generate`` naming it loads it again from that path first (``reload``), so a run
whose adapter was evicted while its agents were quiet gets it back on its next request.
When every loaded adapter is busy or pinned the load is refused.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rl_core.inference.torch_engine.protocol import BadRequest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_MODULES = "all"
_MAX_STACKS = 16  # adapter sets whose stacks are kept (a set is usually the same step after step)
_PEFT_PREFIX = "base_model.model."


class AdapterLoadError(ValueError):
    """The adapter directory cannot be served (missing files, rank too high, wrong modules)."""


@dataclass(eq=False)
class Adapter:
    """One loaded adapter, made from per target module ``(A [r, in], B [out, r])`` and the
    scale; it keeps only what a forward multiplies by (``mats``), not a second copy."""

    name: str
    path: str
    rank: int
    scale: float
    weights: InitVar[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    users: int = 0  # requests admitted under it and not finished; guarded by AdapterSet._lock
    pinned: bool = False  # never evicted (SGLang's ``pinned``)
    idle: threading.Event = field(default_factory=threading.Event)

    # per module (A^T [in, r], scale · B^T [r, out]): what one forward multiplies by
    mats: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.idle.set()
        self.mats = {
            name: (a.T.contiguous(), (self.scale * b).T.contiguous())
            for name, (a, b) in weights.items()
        }


@dataclass(frozen=True)
class _Stack:
    """Several adapters stacked along the rank, for batches whose rows run under different ones.

    ``mats``: per module ``(A^T [in, R], B^T [R, out])`` with R the sum of the ranks (zero
    blocks where an adapter leaves a module alone); ``blocks``: ``[G + 1, R]``, row g is 1
    on adapter g's columns, the last row (the base model) all 0.
    """

    mats: dict[str, tuple[torch.Tensor, torch.Tensor]]
    blocks: torch.Tensor

    @classmethod
    def of(cls, adapters: tuple[Adapter, ...], dtype: torch.dtype, device: Any) -> _Stack:
        shapes = {
            name: (a_t.shape[0], b_t.shape[1])
            for adapter in adapters
            for name, (a_t, b_t) in adapter.mats.items()
        }
        mats = {}
        for name, (fan_in, fan_out) in shapes.items():
            parts = [
                adapter.mats.get(name)
                or (
                    torch.zeros(fan_in, adapter.rank, dtype=dtype, device=device),
                    torch.zeros(adapter.rank, fan_out, dtype=dtype, device=device),
                )
                for adapter in adapters
            ]
            mats[name] = (torch.cat([a for a, _ in parts], 1), torch.cat([b for _, b in parts]))
        ranks = [adapter.rank for adapter in adapters]
        blocks = torch.zeros(len(adapters) + 1, sum(ranks), dtype=dtype, device=device)
        start = 0
        for g, rank in enumerate(ranks):
            blocks[g, start : start + rank] = 1
            start += rank
        return cls(mats, blocks)


def read_adapter(
    path: str, *, dtype: torch.dtype, device: torch.device, max_rank: int | None
) -> tuple[int, float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """``(rank, scale, {module name: (A, B)})`` of the peft adapter at ``path``."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not (directory / ADAPTER_CONFIG).is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise AdapterLoadError(
            f"{path} holds no peft LoRA adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})"
        )
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(f"{path} is a {config.get('peft_type')} adapter, not LoRA")
    for key in (
        "use_dora",
        "rank_pattern",
        "alpha_pattern",
        "modules_to_save",
        "layers_to_transform",
    ):
        if config.get(key):
            raise AdapterLoadError(f"{path}: {key} is not supported by the torch engine")
    if config.get("bias", "none") != "none":
        raise AdapterLoadError(f"{path}: LoRA biases are not supported by the torch engine")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if max_rank is not None and rank > max_rank:
        raise AdapterLoadError(f"{path}: LoRA rank {rank} is above --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                module = key.split(marker)[0].removeprefix(_PEFT_PREFIX)
                pairs.setdefault(module, {})[part] = value.to(device=device, dtype=dtype)
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterLoadError(f"{path}: {module} lacks lora_A or lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if config.get("fan_in_fan_out"):  # Conv1D-style storage: transpose to nn.Linear's
            a, b = b.T.contiguous(), a.T.contiguous()
        weights[module] = (a, b)
    if not weights:
        raise AdapterLoadError(f"{path} holds no LoRA weights")
    return rank, scale, weights


class AdapterSet:
    """The adapters loaded into one engine, and the hooks that apply them per batch row.

    ``acquire``/``release``/``load``/``unregister`` may run on any thread (a lock guards
    the registry and the use counts); ``select`` and the hooks run on the scheduler thread.
    """

    def __init__(
        self,
        model: Any,
        *,
        target_modules: list[str] | None = None,
        max_lora_rank: int | None = None,
        max_loras_per_batch: int = 8,
        max_loaded_loras: int | None = None,
    ):
        self.target_modules = list(target_modules or [ALL_MODULES])
        self.max_lora_rank = max_lora_rank
        self.max_loras_per_batch = max_loras_per_batch
        if max_loaded_loras is not None and max_loaded_loras < max_loras_per_batch:
            raise ValueError(
                f"--max-loaded-loras ({max_loaded_loras}) must be at least "
                f"--max-loras-per-batch ({max_loras_per_batch}), as in SGLang"
            )
        self.max_loaded_loras = max_loaded_loras
        self._lock = threading.Lock()
        # Least recently used first (``acquire`` moves an adapter to the end); guarded by _lock.
        self._adapters: dict[str, Adapter] = {}
        self._evicted: dict[str, str] = {}  # name → path, reloaded on demand; guarded by _lock
        self.evictions = 0
        self.reloads = 0
        # What the hooks add in the running forward (scheduler thread only): per module
        # (A^T, B^T), and the [B, 1, R] mask of each row's columns (None: every row's the same).
        self._mats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mask: torch.Tensor | None = None
        # Stacks of the adapter sets batches have mixed, reused step after step (scheduler
        # thread only); emptied when an adapter leaves memory (``_forgotten`` changes).
        self._stacks: dict[tuple[Adapter, ...], _Stack] = {}
        self._forgotten = 0
        self._stacks_at = 0
        self._handles: list[Any] = []
        self.hooked: set[str] = set()
        self.attach(model)

    # ----- the model

    def attach(self, model: Any) -> None:
        """Hook the target modules of ``model`` (again after a full weight update)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.hooked = [], set()
        self.dtype = model.dtype
        self.device = next(model.parameters()).device
        head = model.get_output_embeddings()
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or module is head:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if ALL_MODULES in self.target_modules or leaf in self.target_modules:
                self._handles.append(module.register_forward_hook(self._hook(name)))
                self.hooked.add(name)
        if not self.hooked:
            raise ValueError(
                f"--lora-target-modules {self.target_modules} names no linear layer of this model"
            )

    def _hook(self, name: str) -> Any:
        def add_delta(module: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> Any:
            pair = self._mats.get(name)
            if pair is None:
                return None
            a_t, b_t = pair
            low = inputs[0] @ a_t  # [B, T, R]
            if self._mask is not None:
                low = low * (self._mask if low.dim() == 3 else self._mask[:, 0])
            return output + low @ b_t

        return add_delta

    def select(self, adapters: list[Adapter | None]) -> None:
        """Set which adapter each row of the next forward pass runs under (None: the base)."""
        present = tuple(dict.fromkeys(a for a in adapters if a is not None))
        if not present:
            self._mats, self._mask = {}, None
        elif len(present) == 1 and None not in adapters:
            self._mats, self._mask = present[0].mats, None
        else:
            if self._stacks_at != self._forgotten or len(self._stacks) > _MAX_STACKS:
                self._stacks, self._stacks_at = {}, self._forgotten
            stack = self._stacks.get(present)
            if stack is None:
                stack = self._stacks[present] = _Stack.of(present, self.dtype, self.device)
            index = {adapter: g for g, adapter in enumerate(present)}
            rows = torch.tensor([index.get(a, len(present)) for a in adapters])  # type: ignore[arg-type]
            self._mats, self._mask = stack.mats, stack.blocks[rows.to(self.device)][:, None, :]

    def fits(self, running: list[Adapter | None], candidate: Adapter | None) -> bool:
        """Whether ``candidate`` may join a batch running ``running`` (``--max-loras-per-batch``)."""
        if candidate is None:
            return True
        distinct = {id(a) for a in running if a is not None}
        return id(candidate) in distinct or len(distinct) < self.max_loras_per_batch

    # ----- the registry

    def load(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Read the adapter at ``path`` and serve it as ``name``; raises ``AdapterLoadError``.

        At ``max_loaded_loras`` the least recently used idle adapter is evicted first.
        """
        with self._lock:
            if name in self._adapters:
                raise AdapterLoadError(f"A LoRA adapter named {name!r} is already loaded.")
        rank, scale, weights = read_adapter(
            path, dtype=self.dtype, device=self.device, max_rank=self.max_lora_rank
        )
        unknown = sorted(set(weights) - self.hooked)
        if unknown:
            raise AdapterLoadError(
                f"{path} adapts modules outside --lora-target-modules {self.target_modules} "
                f"or absent from the model: {unknown[:3]}"
            )
        adapter = Adapter(
            name=name, path=str(path), rank=rank, scale=scale, weights=weights, pinned=pinned
        )
        with self._lock:
            if name in self._adapters:
                raise AdapterLoadError(f"A LoRA adapter named {name!r} is already loaded.")
            if self.max_loaded_loras is not None and len(self._adapters) >= self.max_loaded_loras:
                self._evict_one()
            self._adapters[name] = adapter
            self._evicted.pop(name, None)

    def _evict_one(self) -> None:
        victim = next((a for a in self._adapters.values() if a.users == 0 and not a.pinned), None)
        if victim is None:
            raise AdapterLoadError(
                f"All {len(self._adapters)} loaded LoRA adapters (--max-loaded-loras) are "
                "serving requests or pinned; retry when one is idle."
            )
        del self._adapters[victim.name]
        self._evicted[victim.name] = victim.path
        self._forgotten += 1  # its weights may leave memory: drop the stacks that hold them
        self.evictions += 1

    def reload(self, name: str) -> bool:
        """Load ``name`` again if it was evicted (on any thread but the scheduler's: it reads
        the weights from disk). False when it is loaded already or was never evicted."""
        with self._lock:
            path = self._evicted.get(name)
            if path is None or name in self._adapters:
                return False
        try:
            self.load(name, path)
        except AdapterLoadError:
            with self._lock:
                if name in self._adapters:  # a concurrent request reloaded it first
                    return False
            raise
        with self._lock:
            self.reloads += 1
        return True

    def was_evicted(self, name: str) -> bool:
        """Whether ``name`` is known but out of memory (``reload`` would read it)."""
        with self._lock:
            return name in self._evicted and name not in self._adapters

    def evicted(self) -> list[str]:
        with self._lock:
            return sorted(self._evicted)

    def unregister(self, name: str) -> Adapter | None:
        """Stop admitting requests under ``name``; wait on the result's ``idle`` to free it
        (None: it was evicted, so only its name is forgotten)."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None and self._evicted.pop(name, None) is not None:
                return None
            if adapter is None:
                raise AdapterLoadError(
                    f"LoRA adapter {name!r} is not loaded. Loaded adapters: {sorted(self._adapters)}."
                )
            self._forgotten += 1
            return adapter

    def loaded(self) -> dict[str, str]:
        with self._lock:
            return {name: a.path for name, a in self._adapters.items()}

    def acquire(self, name: str) -> Adapter:
        """The adapter ``name``, counted as used until ``release``; unknown → ``BadRequest``."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise BadRequest(
                    f"The following requested LoRA adapters are not loaded: {name}. "
                    f"Loaded adapters: {sorted(self._adapters)}."
                )
            adapter.users += 1
            adapter.idle.clear()
            self._adapters[name] = self._adapters.pop(name)  # most recently used: last
            return adapter

    def release(self, adapter: Adapter) -> None:
        with self._lock:
            adapter.users -= 1
            if adapter.users == 0:
                adapter.idle.set()
