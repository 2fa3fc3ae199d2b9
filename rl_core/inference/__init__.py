"""Inference servers and the client that talks to them.

Importing this package loads nothing: its names (the HTTP client's) load on first use, so
a module of it that vLLM's own processes import (``rl_core.inference.vllm_transfer``, with
``weight_group``) needs neither httpx nor orjson there; the web process gets the client,
and never torch or transformers. The torch engine (``rl_core.inference.torch_engine``) and
the launchers (``rl_core.inference.launch`` with the interface in
``rl_core.inference.process``, SGLang's in ``rl_core.inference.sglang``, vLLM's in
``rl_core.inference.vllm``) are imported by name where they are needed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "GenerateChunk",
    "GenerateResult",
    "InferenceClient",
    "InferenceError",
    "InferenceUnavailable",
    "parse_weight_version",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("rl_core.inference.client"), name)
    raise AttributeError(f"module 'rl_core.inference' has no attribute {name!r}")
