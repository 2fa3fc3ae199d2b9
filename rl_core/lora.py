"""LoRA runs (``lora_rank > 0``): the adapter around the policy, its checkpoints and the merge.

A LoRA run trains only the adapter (peft's ``LoraConfig``; every linear layer of the
attention and MLP blocks unless ``lora_target_modules`` names some) and never changes
the base weights, so:

* the KL reference is the same model with the adapter disabled (no second copy);
* a checkpoint is the adapter only (``adapter_model.safetensors`` + ``adapter_config.json``,
  whose ``base_model_name_or_path`` names the directory of the weights it applies to);
* what inference servers and exports get is the merged model, ``W + (alpha / r) · B @ A``
  for every adapted ``W`` (Hu et al. 2021, eq. 3), computed beside the training model
  without touching it.

With ``train_workers > 1`` the adapted model is sharded by FSDP2 like any other (frozen base
weights and adapter side by side in each decoder layer's unit): the merge and the adapter's
checkpoint then read full tensors gathered onto rank 0 (``state`` arguments below), and a
resume broadcasts ``read_adapter``'s result from rank 0.

``init_checkpoint`` may name a LoRA checkpoint: the base weights then come from the
directory its adapter applies to; a LoRA run trains that adapter further (same rank and
targets), a full fine-tuning run starts from the merged weights.

A multi-agent run (``cfg.roles``) has one adapter per role on the one base model, each named
by its role (peft's ``add_adapter``), all trainable; a forward runs one of them
(``active_adapter``). Its checkpoint holds each role's adapter as a standard LoRA directory
``<checkpoint>/roles/<role>/``; a one-adapter checkpoint starts every role.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from rl_core.config import RunConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's wrapper before every key of the base model
DEFAULT_ADAPTER = "default"  # peft's name of a one-policy run's adapter
ROLES_DIR = "roles"  # a multi-agent checkpoint's adapters: roles/<role>/


def base_key(name: str) -> str:
    """A key of the adapted model's state dict as the base model names it (its files, its
    servers): peft's prefix and ``.base_layer`` removed."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def record_base(model: Any, base: str | os.PathLike) -> None:
    """Record in ``model``'s adapter config what it applies to, as an absolute path when local:
    checkpoints and exports find their base weights through it."""
    local = Path(base).is_dir()
    for config in model.peft_config.values():
        config.base_model_name_or_path = str(Path(base).resolve()) if local else str(base)


def adapter_names(model: Any) -> list[str]:
    """The adapters of ``model``: ``["default"]``, or a multi-agent run's roles in order."""
    return list(model.peft_config)


def role_checkpoints(path: str | os.PathLike) -> dict[str, Path]:
    """A multi-agent checkpoint's adapter directory of each role (``{}`` for any other)."""
    roles = Path(path) / ROLES_DIR
    if not roles.is_dir():
        return {}
    return {d.name: d for d in sorted(roles.iterdir()) if (d / ADAPTER_CONFIG).is_file()}


def refuse_role_checkpoint(path: str | os.PathLike, what: str) -> None:
    """Raise when ``path`` is a multi-agent checkpoint: ``what`` needs one model, and each
    role's adapter there makes its own (``path/roles/<role>`` is a standard LoRA checkpoint)."""
    roles = role_checkpoints(path)
    if roles and not (Path(path) / ADAPTER_CONFIG).is_file():
        raise ValueError(
            f"{path} is a multi-agent checkpoint: each of its roles ({', '.join(roles)}) is its "
            f"own adapter, so there is no one model to {what}. Use one role's: "
            f"{Path(path) / ROLES_DIR}/<role>."
        )


def is_lora_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a LoRA adapter (a LoRA run's checkpoint), or one
    per role (a multi-agent run's)."""
    return (Path(path) / ADAPTER_CONFIG).is_file() or bool(role_checkpoints(path))


def adapter_base(path: str | os.PathLike) -> str:
    """The directory (or hub id) of the weights the adapter at ``path`` applies to."""
    if not (Path(path) / ADAPTER_CONFIG).is_file() and (roles := role_checkpoints(path)):
        path = next(iter(roles.values()))  # every role applies to the run's one base model
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}/{ADAPTER_CONFIG} does not say which base model it applies to")
    return str(base)


def base_weights_path(path: str | os.PathLike) -> str:
    """Where the base weights of a model at ``path`` are: the adapter's base, or ``path`` itself."""
    return adapter_base(path) if is_lora_checkpoint(path) else str(path)


def lora_config(cfg: RunConfig) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]  # peft divides it by r: a float works
        target_modules=cfg.lora_targets,
        lora_dropout=cfg.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def load_policy(
    path: str | os.PathLike,
    cfg: RunConfig,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None = None,
) -> Any:
    """The model a run starts from: the weights at ``path`` (a model directory, a full
    checkpoint or a LoRA checkpoint), wrapped in a fresh adapter when ``cfg.lora_rank > 0``.

    From a LoRA checkpoint a LoRA run continues its adapter; a full fine-tuning run gets
    the merged weights.
    """
    from peft import PeftModel

    from rl_core.hf import load_causal_lm

    base = base_weights_path(path)
    model = load_causal_lm(base, dtype, device, attn_implementation)
    if not cfg.lora_rank:
        refuse_role_checkpoint(path, "start a full fine-tuning run from")
        if is_lora_checkpoint(path):
            # peft loads the adapter frozen, and its merge leaves the merged weights so.
            model = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
            model.requires_grad_(True)
        return model
    model = with_adapters(model, cfg, base)
    if is_lora_checkpoint(path):
        load_adapter(model, path)
    return model


def with_adapters(model: Any, cfg: RunConfig, base: str | os.PathLike) -> Any:
    """``model`` wrapped by peft with the run's adapter, or one adapter per role of a
    multi-agent run (named by the role, all trainable; the first one active); ``base``
    recorded as what they apply to. Both load paths (whole and sharded) build it here."""
    from peft import get_peft_model

    names = list(cfg.roles) or [DEFAULT_ADAPTER]
    model = get_peft_model(model, lora_config(cfg), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora_config(cfg))
    # peft trains only the active adapter (set_adapter freezes the others): each role trains
    # its own, so all stay trainable and an inactive one simply gets no gradient.
    for param_name, param in model.named_parameters():
        if ".lora_" in param_name:
            param.requires_grad_(True)
    record_base(model, base)
    return model


@contextmanager
def active_adapter(model: Any, name: str) -> Iterator[None]:
    """Run ``model`` with adapter ``name`` (a role) alone active inside; ``""``: as it is.

    peft's ``set_adapter`` also freezes the other adapters: their ``requires_grad`` is put
    back (the optimizer holds every role's parameters; FSDP2 keeps the flags it was built with).
    """
    if not name:
        yield
        return
    previous = model.active_adapter
    _switch_adapter(model, name)
    try:
        yield
    finally:
        _switch_adapter(model, previous)


def _switch_adapter(model: Any, name: str) -> None:
    trainable = [p for n, p in model.named_parameters() if ".lora_" in n and p.requires_grad]
    model.base_model.set_adapter(name)
    for param in trainable:
        param.requires_grad_(True)


def adapter_of(param_name: str) -> str:
    """The adapter a parameter of the adapted model belongs to (``...lora_A.<adapter>.weight``);
    ``""`` for a base weight."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return ""


def load_adapter(model: Any, path: str | os.PathLike) -> None:
    """Copy the adapter weights saved at ``path`` into ``model``'s adapters (same rank and targets)."""
    model.load_state_dict(read_adapter(model, path), strict=False)


def read_adapter(model: Any, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of each of ``model``'s adapters saved at ``path`` (CPU), under ``model``'s
    own key names; raises if they do not fit. A multi-agent model reads each role from
    ``path/roles/<role>``, or every role from ``path`` when it holds one adapter (a one-policy
    checkpoint starts them all). Works on a sharded model too (shapes are the global ones)."""
    roles = role_checkpoints(path)
    state: dict[str, torch.Tensor] = {}
    for name in adapter_names(model):
        if name == DEFAULT_ADAPTER or (Path(path) / ADAPTER_WEIGHTS).is_file():
            source = Path(path)
        elif name in roles:
            source = roles[name]
        else:
            raise ValueError(
                f"the multi-agent checkpoint {path} has no adapter for role {name!r} "
                f"(it has {sorted(roles)}); a run resumes or starts from its own roles"
            )
        state |= _read_one_adapter(model, source, name)
    return state


def _read_one_adapter(model: Any, path: Path, adapter: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = Path(path) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(
            f"{path} holds no LoRA adapter ({ADAPTER_WEIGHTS}): a full fine-tuning checkpoint "
            "cannot resume a LoRA run. Start a new run from it with init_checkpoint, or set lora_rank 0."
        )
    saved = load_file(str(weights))
    names = _peft_names(model, adapter)  # saved name -> model name
    state = {names[k]: v for k, v in saved.items() if k in names}
    missing = sorted(set(names.values()) - set(state))
    unexpected = sorted(set(saved) - set(names))
    if missing or unexpected:
        raise ValueError(
            f"the adapter at {path} does not match this run's lora_target_modules: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k in state}
    wrong = [
        f"{k}: {tuple(v.shape)} vs {shapes[k]}"
        for k, v in state.items()
        if tuple(v.shape) != shapes[k]
    ]
    if wrong:
        raise ValueError(
            f"the adapter at {path} does not fit this run's (lora_rank {model.peft_config[adapter].r}): "
            f"{wrong[:3]}"
        )
    return state


def _peft_names(model: Any, adapter: str = DEFAULT_ADAPTER) -> dict[str, str]:
    """Adapter key in peft's saved format (``...q_proj.lora_A.weight``) -> key in ``model``'s
    state dict (``...q_proj.lora_A.<adapter>.weight``), as peft's own conversion maps them."""
    from peft import get_peft_model_state_dict

    # Distinct placeholders, so the converted entries are found by identity.
    keys = {k: torch.empty(0) for k in model.state_dict() if ".lora_" in k}
    by_id = {id(v): k for k, v in keys.items()}
    converted = get_peft_model_state_dict(
        model, state_dict=keys, adapter_name=adapter, save_embedding_layers=False
    )
    return {k: by_id[id(v)] for k, v in converted.items()}


def save_adapter(
    model: Any, directory: Path, state: dict[str, torch.Tensor] | None = None, role: str = ""
) -> None:
    """The adapter's weights and config (peft's format, loadable by ``PeftModel.from_pretrained``).

    ``state``: the model's state dict (or its adapter part) when the model's own tensors are
    shards: the full tensors gathered by ``rl_core.distributed.full_model_state``.
    A multi-agent model: ``role``'s adapter alone in ``directory`` (a standard adapter
    directory), or with ``role`` "" every role's in ``directory/roles/<role>``.
    """
    # "auto" would look up the base model on the hub to decide whether to save embeddings.
    kwargs: dict[str, Any] = {"save_embedding_layers": False}
    if state is not None:
        kwargs["state_dict"] = state
    names = adapter_names(model)
    if names == [DEFAULT_ADAPTER]:
        model.save_pretrained(str(directory), **kwargs)
    elif not role:  # peft writes a non-default adapter into a folder named after it
        model.save_pretrained(str(directory / ROLES_DIR), selected_adapters=names, **kwargs)
    elif role not in names:
        raise ValueError(f"no adapter for role {role!r}; the run's roles are {names}")
    else:
        model.save_pretrained(str(directory), selected_adapters=[role], **kwargs)
        for f in (directory / role).iterdir():
            f.rename(directory / f.name)
        (directory / role).rmdir()


def hf_model(model: Any) -> Any:
    """The transformers model inside ``model`` (itself when it has no adapter)."""
    return model.get_base_model() if hasattr(model, "peft_config") else model


def reference(model: Any, ref_model: Any) -> Any:
    """Context manager giving the KL reference: ``ref_model``, or ``model`` with its adapter off."""
    if ref_model is not None:
        return nullcontext(ref_model)
    return _adapter_disabled(model)


@contextmanager
def _adapter_disabled(model: Any) -> Iterator[Any]:
    with model.disable_adapter():
        yield model


@torch.no_grad()
def merged_state_dict(
    model: Any, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapted weight replaced by ``W + scale · B @ A``,
    in ``dtype`` and under the base model's own key names. ``model`` is left as it is.

    ``state``: ``model``'s full state dict when its own tensors are shards (FSDP2: what
    ``rl_core.distributed.full_model_state`` gathered; ``{}`` on ranks other than 0 gives
    ``{}``). The sum is taken in float32 (a bf16 ``W`` plus a small update would round it away).
    """
    from peft.tuners.lora import LoraLayer

    state = model.state_dict() if state is None else state
    if not state:
        return {}
    deltas: dict[str, torch.Tensor] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in layer.active_adapters:
            a = state[f"{name}.lora_A.{adapter}.weight"].float()  # [r, in]
            b = state[f"{name}.lora_B.{adapter}.weight"].float()  # [out, r]
            delta = layer.scaling[adapter] * (b @ a)  # [out, in]
            if getattr(layer, "fan_in_fan_out", False):  # GPT-2's Conv1D stores W transposed
                delta = delta.T
            key = f"{name.removeprefix(PEFT_PREFIX)}.weight"
            deltas[key] = deltas[key] + delta if key in deltas else delta
    merged = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        key = base_key(key)
        tensor = value.detach()
        if key in deltas:
            tensor = tensor.float() + deltas.pop(key)
        merged[key] = tensor.to(dtype)
    if deltas:
        raise RuntimeError(f"adapted weights without a base weight: {sorted(deltas)[:5]}")
    return merged
