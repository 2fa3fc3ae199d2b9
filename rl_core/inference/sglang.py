"""Launch SGLang (``python -m sglang.launch_server``) on a GPU machine.

Same interface as the torch engine's launcher (``InferenceServer`` in
``rl_core.inference.process``); ``rl_core.inference.launch`` picks between them. Flag names are SGLang's ``ServerArgs`` CLI flags
(``--model-path``, ``--host``, ``--port``, ``--tp-size``, ``--mem-fraction-static``,
``--max-running-requests``, ``--context-length``, ``--dtype``, ``--base-gpu-id``,
``--served-model-name``, ``--random-seed``, ``--weight-version``, ``--log-level``; for a LoRA
run ``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``, ``--max-loras-per-batch``).

``output_token_logprobs`` must be log-probs of the distribution actually sampled,
``log_softmax(logits / temperature)``: SGLang's default, what the torch engine reports
and what the trainer recomputes per token (``rl_core.sampling``). SGLang reports the
raw-logit (temperature-1) log-prob instead when ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is
true, so the launcher sets it to false, whatever the calling environment says.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from rl_core.inference.process import InferenceServer

# Both spellings: older SGLang releases read RETURN_ORIGINAL_LOGPROB.
LOGPROB_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", "RETURN_ORIGINAL_LOGPROB": "false"}


def lora_flags(
    max_lora_rank: int,
    target_modules: Sequence[str] = (),
    max_loras_per_batch: int | None = None,
    max_loaded_loras: int | None = None,
) -> list[str]:
    """SGLang's multi-LoRA flags (the torch engine takes the same); ``[]`` when rank is 0.

    ``target_modules`` uses peft's names; empty or peft's ``all-linear`` is SGLang's ``all``.
    """
    if max_lora_rank <= 0:
        return []
    modules = [m for m in target_modules if m != "all-linear"] or ["all"]
    flags = [
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank),
        "--lora-target-modules",
        *modules,
    ]
    if max_loras_per_batch is not None:
        flags += ["--max-loras-per-batch", str(max_loras_per_batch)]
    if max_loaded_loras is not None:
        flags += ["--max-loaded-loras", str(max_loaded_loras)]
    return flags


class SGLangServer(InferenceServer):
    """One SGLang server process on this machine's GPU(s)."""

    backend = "sglang"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        tensor_parallel: int = 1,
        mem_fraction_static: float | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        dtype: str | None = None,
        base_gpu_id: int | None = None,
        served_model_name: str | None = None,
        random_seed: int | None = None,
        log_level: str | None = None,
        lora_rank: int = 0,
        lora_target_modules: Sequence[str] = (),
        max_loras_per_batch: int | None = None,
        max_loaded_loras: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(model_path, **kwargs)
        self.tensor_parallel = tensor_parallel
        self.mem_fraction_static = mem_fraction_static
        self.max_running_requests = max_running_requests
        self.context_length = context_length
        self.dtype = dtype
        self.base_gpu_id = base_gpu_id
        self.served_model_name = served_model_name
        self.random_seed = random_seed
        self.log_level = log_level
        self.lora = lora_flags(
            lora_rank, lora_target_modules, max_loras_per_batch, max_loaded_loras
        )

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--weight-version", self.weight_version,
            "--tp-size", str(self.tensor_parallel),
        ]  # fmt: skip
        optional = {
            "--mem-fraction-static": self.mem_fraction_static,
            "--max-running-requests": self.max_running_requests,
            "--context-length": self.context_length,
            "--dtype": self.dtype,
            "--base-gpu-id": self.base_gpu_id,
            "--served-model-name": self.served_model_name,
            "--random-seed": self.random_seed,
            "--log-level": self.log_level,
        }
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + self.lora + self.extra_args

    def environment(self) -> dict[str, str]:
        return {**super().environment(), **LOGPROB_ENV}
