"""A checkpoint as a standalone Hugging Face model folder.

``python -m rl_core.export CHECKPOINT OUT`` writes ``OUT`` (atomically: beside it, then
renamed), loadable by ``AutoModelForCausalLM.from_pretrained`` and servable by SGLang
(``--model-path OUT``):

* a full fine-tuning checkpoint's float32 weights cast to the base model's dtype;
* a LoRA checkpoint's adapter merged into the weights it applies to (``rl_core.lora``);

a tensor at a time (any model size: no model is built, memory is one tensor and one output
file of at most 1 GiB).

The dtype is the run's ``base_model``'s (what its inference servers loaded), read from the
checkpoint's ``trainer_state.pt``. The web app runs this in a subprocess (the web process
never imports torch); progress lines go to stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from rl_core import lora
from rl_core.hf import TOKENIZER_FILES, config_dtype, record_dtype
from rl_core.sharded_load import AdapterDeltas
from rl_core.streamed_weights import Entry, write_folder
from rl_core.trainer_saving import TRAINER_STATE


def _say(message: str) -> None:
    print(message, flush=True)


def export_dtype(checkpoint: Path) -> torch.dtype:
    """The dtype an export of ``checkpoint`` is written in: its run's base model's."""
    state_file = checkpoint / TRAINER_STATE
    if state_file.is_file():
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        base = state.get("config", {}).get("base_model")
        if base:
            return config_dtype(base)
    return config_dtype(lora.base_weights_path(checkpoint))


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the merged (or cast) model of ``checkpoint`` to ``out``; returns ``out``.

    Streamed: each tensor is read from the checkpoint's (or the adapter's base's) safetensors
    files, merged with the adapter's ``scale · B @ A`` where it applies, cast and added to
    an output file of at most 1 GiB; no model is built, so memory is a tensor and a file.
    """
    from safetensors import safe_open

    source, target = Path(checkpoint), Path(out)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint directory {source} does not exist")
    lora.refuse_role_checkpoint(source, "export")
    dtype = export_dtype(source)
    weights = Path(lora.base_weights_path(source))
    deltas = AdapterDeltas(source) if lora.is_lora_checkpoint(source) else None
    files = sorted(weights.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {weights}")
    entries, where = [], {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                view = handle.get_slice(key)
                stored = _DTYPES.get(view.get_dtype(), torch.float32)
                cast = dtype if stored.is_floating_point else stored
                entries.append(Entry(key, key, tuple(view.get_shape()), cast))
                where[key] = f
    merging = " and merging the adapter" if deltas is not None else ""
    _say(f"streaming {len(entries)} tensors from {weights}{merging}")

    def tensors(keep: Any) -> Any:
        for entry in entries:
            with safe_open(str(where[entry.name]), framework="pt") as handle:
                tensor = handle.get_tensor(entry.name)
            delta = deltas.rows(entry.name, 0, entry.shape[0]) if deltas is not None else None
            if delta is not None:
                tensor = tensor.float() + delta
            yield entry, tensor.to(entry.dtype)

    _say(f"writing {target} ({str(dtype).removeprefix('torch.')})")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_folder(tmp, entries, tensors)
    shutil.copy2(weights / "config.json", tmp / "config.json")
    record_dtype(tmp / "config.json", dtype)
    if (weights / "generation_config.json").is_file():
        shutil.copy2(weights / "generation_config.json", tmp / "generation_config.json")
    for pattern in TOKENIZER_FILES:
        for f in source.glob(pattern):
            shutil.copy2(f, tmp / f.name)
    old = target.with_name(target.name + ".old")
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    _say("done")
    return target


# safetensors' dtype names
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a run's checkpoint directory (full or LoRA)")
    parser.add_argument("out", help="where to write the model folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(
        int(os.environ.get("STEEP_TORCH_THREADS", "0")) or torch.get_num_threads()
    )
    export_checkpoint(args.checkpoint, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
