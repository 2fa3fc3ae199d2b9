"""A checkpoint as a standalone Hugging Face model folder.

``python -m rl_core.export CHECKPOINT OUT`` writes ``OUT`` (atomically: beside it, then
renamed), loadable by ``AutoModelForCausalLM.from_pretrained`` and servable by SGLang
(``--model-path OUT``):

* a full fine-tuning checkpoint's float32 weights cast to the base model's dtype;
* a LoRA checkpoint's adapter merged into the weights it applies to (``rl_core.lora``).

The dtype is the run's ``base_model``'s (what its inference servers loaded), read from the
checkpoint's ``trainer_state.pt``. The web app runs this in a subprocess (the web process
never imports torch); progress lines go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from rl_core import lora
from rl_core.hf import TOKENIZER_FILES, config_dtype, load_causal_lm
from rl_core.trainer import TRAINER_STATE


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
    """Write the merged (or cast) model of ``checkpoint`` to ``out``; returns ``out``."""
    from peft import PeftModel

    source, target = Path(checkpoint), Path(out)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint directory {source} does not exist")
    dtype = export_dtype(source)
    cpu = torch.device("cpu")
    model: Any
    if lora.is_lora_checkpoint(source):
        base = lora.adapter_base(source)
        _say(f"loading the base weights from {base}")
        model = PeftModel.from_pretrained(load_causal_lm(base, torch.float32, cpu), str(source))
        _say("merging the adapter")
        state = lora.merged_state_dict(model, dtype)
        model = model.get_base_model()
    else:
        _say(f"loading the weights from {source}")
        model = load_causal_lm(source, torch.float32, cpu)
        state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    _say(f"writing {target} ({str(dtype).removeprefix('torch.')})")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state)
    config_file = tmp / "config.json"
    config = json.loads(config_file.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2))
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
