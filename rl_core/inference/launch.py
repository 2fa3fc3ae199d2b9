"""Start, health-check and stop inference servers as subprocesses, whatever the backend.

A run's Ray job starts one server per replica with ``make_inference_server(...)``
and hands each ``server.url`` to the client of its backend. The torch engine and SGLang
speak SGLang's native HTTP API; vLLM's client translates it to vLLM's routes, so nothing
above the client knows which one runs:

    server = make_inference_server("auto", model_path, port=free_port(), weight_version=0)
    with server:                      # start() + wait_healthy(); stop() on exit
        ...  # client_for(server.backend, server.url)

Every launcher implements one interface, ``InferenceServer`` (``start``,
``wait_healthy``, ``url``, ``stop``; in ``rl_core.inference.process``):
``TorchEngineServer`` here, ``SGLangServer`` in ``rl_core.inference.sglang``, ``VLLMServer``
in ``rl_core.inference.vllm`` (whose client, ``client_for("vllm", url)``, speaks vLLM's routes
under the same interface). ``LAUNCHERS`` maps each backend name of
``rl_core.config.INFERENCE_BACKENDS`` but ``auto`` to its launcher. ``auto`` picks SGLang when
it is installed and a CUDA GPU is visible, otherwise the torch engine. This module imports
neither torch, sglang nor vllm at import time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_core.config import INFERENCE_BACKENDS
from rl_core.inference.process import InferenceServer, ServerStartError, free_port
from rl_core.inference.sglang import SGLangServer, lora_flags
from rl_core.inference.vllm import VLLMServer, vllm_available, vllm_python

__all__ = [
    "LAUNCHERS",
    "InferenceServer",
    "SGLangServer",
    "ServerStartError",
    "TorchEngineServer",
    "VLLMServer",
    "choose_backend",
    "free_port",
    "make_inference_server",
    "sglang_available",
]


class TorchEngineServer(InferenceServer):
    """``python -m rl_core.inference.torch_engine`` (CPU, or one GPU without SGLang)."""

    backend = "torch"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        max_running_requests: int = 32,
        num_threads: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        context_length: int | None = None,
        lora_rank: int = 0,
        lora_target_modules: Sequence[str] = (),
        max_loras_per_batch: int | None = None,
        max_loaded_loras: int | None = None,
        tensor_parallel: int = 1,
        **kwargs: Any,
    ):
        if tensor_parallel != 1:
            raise ValueError(
                "the torch engine serves a model on one device (tensor_parallel 1); "
                "SGLang and vLLM split one over several GPUs"
            )
        super().__init__(model_path, **kwargs)
        self.lora = lora_flags(
            lora_rank, lora_target_modules, max_loras_per_batch, max_loaded_loras
        )
        self.max_running_requests = max_running_requests
        self.num_threads = num_threads
        self.dtype = dtype
        self.device = device
        self.context_length = context_length

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "rl_core.inference.torch_engine",
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--weight-version", self.weight_version,
            "--max-running-requests", str(self.max_running_requests),
            "--dtype", self.dtype,
            "--device", self.device,
            "--parent-pid", str(os.getpid()),  # its own session: exit with its owner
        ]  # fmt: skip
        if self.num_threads:
            cmd += ["--num-threads", str(self.num_threads)]
        if self.context_length:
            cmd += ["--context-length", str(self.context_length)]
        return cmd + self.lora + self.extra_args

    def environment(self) -> dict[str, str]:
        env = super().environment()
        # The engine must import rl_core even when the caller runs from elsewhere.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return env


def sglang_available() -> bool:
    """True when ``import sglang`` works and torch sees a CUDA GPU."""
    try:
        import sglang  # noqa: F401
        import torch
    except Exception:
        return False
    return bool(torch.cuda.is_available())


# The launcher of each concrete backend. The backend names a run may ask for are
# rl_core.config.INFERENCE_BACKENDS: these plus "auto" (a test holds them equal).
LAUNCHERS: dict[str, type[InferenceServer]] = {
    cls.backend: cls for cls in (TorchEngineServer, SGLangServer, VLLMServer)
}


def choose_backend(backend: str = "auto") -> str:
    """Resolve ``auto`` to ``sglang`` (installed + CUDA) or ``torch``; check explicit choices."""
    if backend not in INFERENCE_BACKENDS:
        raise ValueError(
            f"inference backend {backend!r} is not one of {', '.join(INFERENCE_BACKENDS)}"
        )
    if backend == "auto":
        return "sglang" if sglang_available() else "torch"
    if backend == "sglang" and not sglang_available():
        raise ValueError(
            "inference_backend is 'sglang' but sglang is not installed or no CUDA GPU is visible; "
            "install steep[gpu] on a GPU machine, or set inference_backend to 'torch' or 'auto'."
        )
    if backend == "vllm" and not vllm_available():
        raise ValueError(
            f"inference_backend is 'vllm' but vLLM's environment is missing ({vllm_python()}): "
            "run ./steep install --vllm on a CPU machine, use the GPU image on GPU nodes, or "
            "set STEEP_VLLM_PYTHON to the interpreter of an environment with vllm."
        )
    return backend


def make_inference_server(
    backend: str, model_path: str | os.PathLike[str], **kwargs: Any
) -> InferenceServer:
    """An (unstarted) server for ``backend`` (``auto``/``torch``/``sglang``/``vllm``); kwargs go
    to its class. Every launcher takes ``tensor_parallel`` and the LoRA keywords of
    ``lora_flags`` (``lora_rank``, ``lora_target_modules``, ``max_loras_per_batch``,
    ``max_loaded_loras``)."""
    return LAUNCHERS[choose_backend(backend)](model_path, **kwargs)
