"""The trainer's memory settings: compute precision and a per-step peak-memory meter."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def resolve_precision(setting: str, device: torch.device) -> str:
    """``RunConfig.precision`` on ``device`` as the compute precision, ``"fp32"`` or ``"bf16"``.

    ``auto`` is bf16 on CUDA (autocast; parameters, gradients and optimizer state stay
    float32) and fp32 elsewhere: CPU bf16 matmuls are slower than float32 on most
    x86 machines. ``bf16`` on CPU is allowed here for benchmarks; the run form refuses
    it for CPU-only clusters.
    """
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if setting in ("fp32", "bf16"):
        return setting
    raise ValueError(f"unknown precision {setting!r}; use auto, fp32 or bf16")


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant).

    Non-reentrant checkpointing needs no ``requires_grad`` inputs, so it also works when
    only adapter weights train (LoRA). transformers 5 renamed the method.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class PeakMemory:
    """Peak memory during one train step, in GB (10^9 bytes): ``perf/peak_memory_gb``.

    CUDA: ``torch.cuda.max_memory_allocated`` since ``start()`` (tensors this process
    allocated on its device: weights, gradients, optimizer state and activations; not
    the caching allocator's reserve). CPU: the process's peak resident set size since
    ``start()`` (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), which also
    counts the interpreter, libraries and allocator slack; where the reset is not
    allowed, the process's lifetime peak (``ru_maxrss``).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.start_gb = 0.0

    def start(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_gb = torch.cuda.memory_allocated(self.device) / 1e9
        else:
            try:
                _CLEAR_REFS.write_text("5")  # 5: reset the peak RSS to the current RSS
            except OSError:
                pass
            self.start_gb = _status_kb("VmRSS") / 1e6
        return self

    def peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        peak_kb = _status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak_kb / 1e6


def _status_kb(field: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
