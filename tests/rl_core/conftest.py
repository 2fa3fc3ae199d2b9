"""Shared fixtures for rl_core tests: the tiny model and real torch-engine servers on 127.0.0.1.

- ``tiny_model_dir``: a directory with the tiny Llama model + tokenizer (``rl_core.tiny``),
  built once per session.
- ``torch_engine``: a running torch engine serving it (session-wide; tests must not
  pause it or change its weights — use ``torch_engine_factory`` for that).
- ``torch_engine_factory``: ``start(model_path=None, **kwargs) -> TorchEngineServer``,
  a fresh healthy server of your own; all are stopped at session end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rl_core.inference.launch import TorchEngineServer


@pytest.fixture(scope="session")
def torch_engine_factory(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., TorchEngineServer]]:
    servers: list[TorchEngineServer] = []
    logs = tmp_path_factory.mktemp("engine-logs")

    def start(model_path: str | Path | None = None, **kwargs: Any) -> TorchEngineServer:
        # One torch thread per server: tests run on 2 cores beside the test process.
        kwargs.setdefault("num_threads", 1)
        kwargs.setdefault("log_path", logs / f"engine-{len(servers)}.log")
        server = TorchEngineServer(model_path or tiny_model_dir, host="127.0.0.1", **kwargs)
        servers.append(server)
        server.start()
        server.wait_healthy(timeout=120)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def torch_engine(torch_engine_factory: Callable[..., TorchEngineServer]) -> TorchEngineServer:
    return torch_engine_factory(weight_version=0)


class Reference:
    """Recompute with plain full forward passes (no KV cache), independent of the engine's code."""

    def __init__(self) -> None:
        self._models: dict[str, Any] = {}

    def model(self, model_dir: str | Path) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        key = str(model_dir)
        if key not in self._models:
            self._models[key] = AutoModelForCausalLM.from_pretrained(
                key, dtype=torch.float32
            ).eval()
        return self._models[key]

    def logprobs(
        self, model_dir: str | Path, prompt: list[int], output: list[int], temperature: float = 1.0
    ) -> Any:
        """Log-prob of each output token given everything before it: log_softmax(logits / T)."""
        import torch

        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = self.model(model_dir)(ids).logits[0, len(prompt) - 1 : -1]  # [n_out, V]
        return torch.log_softmax(logits.float() / temperature, dim=-1).gather(
            -1, torch.tensor(output)[:, None]
        )[:, 0]

    def greedy(self, model_dir: str | Path, prompt: list[int], n: int) -> list[int]:
        import torch

        ids = list(prompt)
        model = self.model(model_dir)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()
