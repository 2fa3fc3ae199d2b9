"""The names of a LoRA run's adapters on its inference servers (no torch: the gateway uses it).

A LoRA run publishes policy version ``N`` as an adapter named ``<prefix>-v<N>`` (the
prefix is the run's id), loaded beside the base model (``rl_core.adapter_sync``). Callers
send that name as ``lora_path`` on ``/generate``; the client tags the tokens generated
under it with version ``N``. Version 0 of a run that starts from the base model is the
base model itself (a fresh adapter has ``B = 0``), so no adapter is named for it.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"-v(\d+)$")


def adapter_name(prefix: str, version: int) -> str:
    return f"{prefix}-v{int(version)}"


def adapter_version(name: str | None) -> int | None:
    """``N`` of an adapter named ``<prefix>-v<N>``; None for any other name."""
    match = _NAME.search(name or "")
    return int(match.group(1)) if match else None


def current_adapter(
    prefix: str, version: int, *, lora_rank: int, init_checkpoint: str | None = None
) -> str | None:
    """The ``lora_path`` new requests of a run send at policy ``version``: None for a full
    fine-tuning run, and for version 0 of a LoRA run that starts from the base model."""
    if not lora_rank or (int(version) == 0 and not init_checkpoint):
        return None
    return adapter_name(prefix, version)
