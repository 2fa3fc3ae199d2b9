"""Hugging Face causal LMs as the trainer, LoRA and exports load them, and their tokenizer files."""

from __future__ import annotations

import functools
import inspect
import json
import os
from typing import Any

import torch
from packaging.version import Version

# A model directory's tokenizer files, copied as they are into saved weights and exports.
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "*.jinja",
    "chat_template*",
    "*.model",
)


def dtype_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    # `dtype` replaced `torch_dtype` in transformers 4.56; older releases ignore it.
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword ``model``'s forward takes a KV cache under: ``cache`` from
    transformers 5.2x on, ``past_key_values`` before (the old name warns there, and goes in 5.40)."""
    if hasattr(model, "get_base_model"):  # a peft wrapper forwards **kwargs to the base model
        model = model.get_base_model()
    return {_cache_keyword(type(model).forward): cache}


@functools.cache
def _cache_keyword(forward: Any) -> str:
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward with ``use_cache=True`` returned, under either release's name."""
    cache = getattr(output, "cache", None)  # transformers 5.2x; older outputs lack the field
    return cache if cache is not None else output.past_key_values


def load_causal_lm(
    path: str | os.PathLike,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None = None,
) -> Any:
    """A HF causal LM from a local directory (or hub id), dropout disabled.

    Dropout off keeps θ == p at the start of a step (ratio exactly 1) and makes the
    recomputed logprobs deterministic; RL fine-tuning does not want it anyway.
    ``attn_implementation`` None keeps transformers' default (sdpa).
    """
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), **dtype_kwargs(dtype), **extra)
    model.to(device)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def record_dtype(config_file: str | os.PathLike, dtype: torch.dtype) -> None:
    """Rewrite the ``dtype`` (or older ``torch_dtype``) that ``config_file`` records as the
    dtype its weights were written in: ``save_pretrained`` records the in-memory one."""
    from pathlib import Path

    path = Path(config_file)
    if not path.exists():
        return
    config = json.loads(path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2))


def config_dtype(path: str | os.PathLike) -> torch.dtype:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path))
    dtype = cfg.__dict__.get("dtype") or cfg.__dict__.get("torch_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def read_safetensors(path: str | os.PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path`` (a checkpoint or saved weights)."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in checkpoint {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=device))
    return state
