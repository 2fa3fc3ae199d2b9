"""Inference servers and the client that talks to them.

Importing this package loads only the HTTP client (httpx), never torch or
transformers: the web process imports it. The torch engine
(``rl_core.inference.torch_engine``) and the launchers (``rl_core.inference.launch``
with the interface in ``rl_core.inference.process`` and SGLang's in
``rl_core.inference.sglang``) are imported by name where they are needed.
"""

from rl_core.inference.client import (
    GenerateChunk,
    GenerateResult,
    InferenceClient,
    InferenceError,
    InferenceUnavailable,
    parse_weight_version,
)

__all__ = [
    "GenerateChunk",
    "GenerateResult",
    "InferenceClient",
    "InferenceError",
    "InferenceUnavailable",
    "parse_weight_version",
]
