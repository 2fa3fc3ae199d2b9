"""Sharded training with FSDP2: token-balanced shards, model wrapping, full state dicts.

``PPOTrainer`` uses this when ``train_workers > 1`` processes joined one
``torch.distributed`` group (``workers.trainer_group`` starts them as Ray actors):

- ``rank_micro_batches`` splits every minibatch's sequences over the ranks by token
  count (longest first, each to the least-loaded rank), then packs each rank's share
  into micro-batches. Every rank computes every rank's share, so all of them know how
  many micro-batches the busiest rank runs: FSDP2 gathers parameters in each forward
  and reduce-scatters gradients in each backward, so a rank with fewer micro-batches
  must run padding ones (zero loss weight) or the others wait for it forever.
- ``shard_model`` puts every decoder layer and the root into ``fully_shard``; with a
  bf16 ``param_dtype`` the forward and backward compute in bf16 while the sharded
  master parameters, their gradients and AdamW's state stay float32, and gradients
  are reduced in float32. Gradients are *summed* over ranks (not averaged), because
  the loss is already divided by the whole minibatch's token count.
- A LoRA adapter and its optimizer state (small) are gathered whole onto rank 0's CPU
  and broadcast back from it; a full model's weights are never gathered
  (``rl_core.streamed_weights``, ``rl_core.sharded_load``) and its optimizer state is
  saved and loaded shard by shard (``save_sharded_optimizer``, ``load_sharded_optimizer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rl_core import prefix_tree
from rl_core.packing import micro_batches

T = TypeVar("T")


def balanced_shards(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices into ``lengths`` for each rank, balancing the tokens each rank gets.

    Longest-processing-time-first: sequences in decreasing length (ties by index) go to
    the rank with the fewest tokens so far (ties to the lowest rank). Deterministic, so
    every rank computes the same split; each shard is returned in index order.
    """
    shards: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(s) for s in shards]


def rank_micro_batches(
    lengths: Sequence[int], world_size: int, rank: int, max_tokens: int
) -> tuple[list[list[int]], int]:
    """``rank``'s micro-batches (lists of indices into ``lengths``) and the most any rank has.

    Pad up to that count when every rank must run the same number of forwards (FSDP2).
    """
    counts, mine = [], []
    for r, shard in enumerate(balanced_shards(lengths, world_size)):
        groups = micro_batches([lengths[i] for i in shard], max_tokens)
        counts.append(len(groups))
        if r == rank:
            mine = [[shard[j] for j in group] for group in groups]
    return mine, max(counts)


def tree_rank_micro_batches(
    seqs: Sequence[Sequence[int]], world_size: int, rank: int, max_tokens: int
) -> tuple[list[list[int]], int]:
    """``rank_micro_batches`` for prefix-tree packing: sequences that share a prefix stay
    together (``prefix_tree.chunks``), and ranks and micro-batches are balanced by the tokens
    each chunk's tree computes, not by its sequences' lengths."""
    groups, costs = prefix_tree.chunks(seqs, max_tokens)
    counts, mine = [], []
    for r, shard in enumerate(balanced_shards(costs, world_size)):
        bins = micro_batches([costs[i] for i in shard], max_tokens)
        counts.append(len(bins))
        if r == rank:
            mine = [sorted(j for b in bin_ for j in groups[shard[b]]) for bin_ in bins]
    return mine, max(counts)


def _layer_classes(model: torch.nn.Module) -> set[str]:
    # HF models name their decoder layer class in _no_split_modules (also under a peft wrapper).
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_model(
    model: torch.nn.Module,
    *,
    param_dtype: torch.dtype | None = None,
    mesh: Any = None,
    offload: bool = False,
) -> None:
    """``fully_shard`` each decoder layer, then the root (in place; parameters become DTensors).

    ``param_dtype`` (e.g. ``torch.bfloat16``): compute dtype of forward and backward, with
    float32 sharded parameters and gradient reduction. Build the optimizer afterwards.
    ``mesh``: the device mesh to shard over (default: every rank of the default group).
    ``offload``: FSDP2's CPU offload (run setting ``cpu_offload``): the sharded parameters,
    their gradients and so the optimizer's state and step stay in (pinned) CPU memory, each
    unit's parameters copied to the device for its forward and backward.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

    kwargs: dict[str, Any] = {} if mesh is None else {"mesh": mesh}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if param_dtype is not None and param_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32
        )
    layer_classes = _layer_classes(model)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layer_classes:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not mean, over ranks; SUM collectives only (gloo has no PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def parameter_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """Each parameter's names, by its ``id``: tied weights have several (``lm_head`` =
    ``embed_tokens``), saved under one of them."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, Any]:
    """The unsharded state dict on rank 0's CPU (empty on other ranks). A collective.

    ``trainable_only``: the parameters that train (a LoRA adapter), not the frozen rest.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    options = _options(cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The unsharded optimizer state (keyed by parameter name) on rank 0's CPU. A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_state: dict[str, Any] | None,
    optimizer_state: dict | None = None,
) -> None:
    """Load full state dicts that rank 0 holds (other ranks pass ``{}``) into the shards of
    every rank. A collective. ``model_state``: some of the model's keys (a LoRA adapter; the
    rest stay as they are), or None for the optimizer's state alone. A full model's weights
    are read by every rank from the files instead (``rl_core.sharded_load.fill_from_files``)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if model_state is not None:
        options = _options(broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, model_state, options=options)
    if optimizer is not None and optimizer_state is not None:
        set_optimizer_state_dict(
            model, optimizer, optimizer_state, options=_options(broadcast_from_rank0=True)
        )


def optimizer_state_by_name(state: dict, names: Sequence[str]) -> dict:
    """``torch.optim`` state keyed by parameter index -> by parameter name (the format of
    ``full_optimizer_state``, which a run on any number of workers loads). ``names``: the
    optimizer's parameters' names, in its order. Already by name: returned as is."""
    if not _by_index(state):
        return state
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def optimizer_state_by_index(state: dict, names: Sequence[str]) -> dict:
    """The inverse of ``optimizer_state_by_name`` (what ``Optimizer.load_state_dict`` takes)."""
    if _by_index(state):
        return state
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[k]: v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [index[k] for k in g["params"]]} for g in state["param_groups"]
        ],
    }


def _by_index(state: dict) -> bool:
    return all(isinstance(p, int) for g in state["param_groups"] for p in g["params"])


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (small Python objects: versions, RNG states)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(read: Callable[[], T], default: T) -> T:
    """``read()`` on rank 0, ``default`` on the others. What it raises is raised on every
    rank, so no rank is left waiting in the collective that would have followed."""
    result, error = default, None
    if dist.get_rank() == 0:
        try:
            result = read()
        except Exception as exc:  # re-raised below, on every rank
            error = exc
    if (error := broadcast_from_rank0(error)) is not None:
        raise error
    return result


def save_sharded_optimizer(model: torch.nn.Module, optimizer: Any, directory: str) -> None:
    """The optimizer state as ``torch.distributed.checkpoint`` files: each rank writes its own
    shards (keyed by parameter name), rank 0 the metadata. A collective under FSDP2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=directory)


def load_sharded_optimizer(model: torch.nn.Module, optimizer: Any, directory: str) -> None:
    """Read ``save_sharded_optimizer``'s files into ``optimizer``, resharded to this run's
    workers (any number; a single unsharded process too)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=directory)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
