"""Read a saved model's tensors into staging buffers for ``/update_weights_from_disk``.

``from_pretrained`` would build a whole new model whose parameters stay backed by the
safetensors file's memory map: the swap itself is a pointer swap, but the first decode
steps after it fault every page of the new weights in on the scheduler thread, a
client-visible stall that ``swap_seconds`` does not show. ``read_staged`` instead reads
every tensor of the directory's ``*.safetensors`` files into fresh memory on the
serving device, in the served dtype, beside generation; ``TorchEngine.install_weights``
then swaps the staged tensors in between two decode steps, as for a distributed update.

A directory it cannot stage (no safetensors files, or tensor names that are not the
served model's state-dict names) raises ``NotStageable``; the server then falls back to
``from_pretrained`` (``TorchEngine.load_weights``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class NotStageable(ValueError):
    """The directory's tensors cannot be read by name into the served model."""


def read_staged(path: str, model: Any) -> dict[str, torch.Tensor]:
    """Every tensor under ``path``, copied into fresh memory like the served ``model``'s.

    Raises ``NotStageable`` (use ``from_pretrained``: unknown names, or a served tensor
    missing that is no tied alias of one present) or ``ValueError`` (a shape differs).
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise NotStageable(f"{path} holds no .safetensors files")
    state = model.state_dict()
    staged: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            keys = list(handle.keys())
            unknown = [k for k in keys if k not in state]
            if unknown:
                raise NotStageable(
                    f"{file.name}: tensors the served model lacks, e.g. {unknown[:3]}"
                )
            for key in keys:
                served = state[key]
                tensor = handle.get_tensor(key)  # backed by the file's memory map
                if tuple(tensor.shape) != tuple(served.shape):
                    raise ValueError(
                        f"{key}: shape {list(tensor.shape)} != the served {list(served.shape)}"
                    )
                # copy=True: fresh memory, read now (off the scheduler thread), not on first use.
                staged[key] = tensor.to(device=served.device, dtype=served.dtype, copy=True)
    loaded = {state[k].data_ptr() for k in staged}
    missing = [k for k in state if k not in staged and state[k].data_ptr() not in loaded]
    if missing:  # a tied alias (lm_head of tied embeddings) shares a loaded tensor's memory
        raise NotStageable(f"{path} lacks tensors of the served model, e.g. {missing[:3]}")
    return staged


def load_model(
    path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Any:
    """Load a causal LM from a local directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def check_same_shapes(old: Any, new: Any) -> None:
    old_shapes = {k: tuple(v.shape) for k, v in old.state_dict().items()}
    new_shapes = {k: tuple(v.shape) for k, v in new.state_dict().items()}
    if old_shapes != new_shapes:
        diff = sorted(set(old_shapes.items()) ^ set(new_shapes.items()))[:3]
        raise ValueError(
            f"the new weights do not match the served model's architecture (e.g. {diff})"
        )
