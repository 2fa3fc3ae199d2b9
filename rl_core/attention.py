"""Padding-free attention over packed sequences, without a ``T x T`` mask.

A packed micro-batch is one row ``[1, T]`` of several sequences (``rl_core.packing``).
Each token must attend only to earlier tokens of its own sequence. A dense additive
block-diagonal mask does that but costs ``T^2`` memory and compute (256 MiB of float32
mask alone at T = 8,192, and attention over every pair of the row). Instead the
model's attention runs per sequence, so memory and compute grow with ``sum(L_i^2)``
(less with the flash kernels, which never materialise scores):

- ``flash_attention_2`` when the ``flash_attn`` package is installed on CUDA:
  transformers' own varlen path reads the boundaries from ``cu_seq_lens_q/k``.
- otherwise ``PACKED_ATTENTION`` (registered here with transformers'
  ``AttentionInterface``): on CUDA in bf16/fp16, PyTorch's varlen flash kernel
  (``torch.nn.attention.varlen.varlen_attn``); anywhere else, causal SDPA once per
  sequence. A matching ``AttentionMaskInterface`` entry that returns ``None`` keeps
  transformers from building any mask for it.

``packed_attention_kwargs`` gives the forward kwargs both paths read; transformers
(>= 4.53, where masks moved to ``masking_utils``) hands them to the attention function.

A row laid out as a prefix tree (``rl_core.prefix_tree``, ``tree_attention_kwargs``) runs
through ``PACKED_ATTENTION`` one tree node at a time: a node's tokens attend to their
ancestors' keys and, causally, to their own (SDPA with the causal mask aligned to the lower
right), in memory per node of a flat sequence of the same length.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch
import torch.nn.functional as F

PACKED_ATTENTION = "steep_packed"
PACKED_IMPLEMENTATIONS = (PACKED_ATTENTION, "flash_attention_2", "flash_attention_3")
SEQ_LENGTHS = "steep_seq_lengths"  # forward kwarg: the packed sequences' lengths, Python ints
TREE_NODES = "steep_tree_nodes"  # forward kwarg: a prefix tree's nodes (tree_attention_kwargs)

_registered = False


def register_packed_attention() -> str:
    """Make ``PACKED_ATTENTION`` a valid ``attn_implementation`` (idempotent); returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
        AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)
        _registered = True
    return PACKED_ATTENTION


def packed_attention_implementation(device: torch.device, *, tree: bool = False) -> str:
    """The ``attn_implementation`` to load a trained model with on ``device``: Steep's own
    for prefix trees (``tree``), which transformers' flash path does not know."""
    if tree:
        return register_packed_attention()
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return register_packed_attention()


def packed_attention_kwargs(
    cu_seqlens: torch.Tensor, lengths: list[int] | None = None
) -> dict[str, Any]:
    """Forward kwargs that tell a packed-attention model where sequences start and end.

    ``cu_seqlens`` ``[S + 1]`` (int32, starting at 0) on the model's device. The names are
    transformers' ``FlashAttentionKwargs``, which its flash path reads as they are.
    ``lengths``: the same boundaries as Python ints, when the caller has them
    (``PackedBatch.lengths``): then nothing here or in the layers reads a device tensor
    back to the host, and a model of fake tensors (``rl_core.memory_plan``) can run.
    """
    cu = cu_seqlens.to(torch.int32)
    max_len = max(lengths) if lengths else int((cu[1:] - cu[:-1]).max().item())
    kwargs: dict[str, Any] = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
    if lengths:
        kwargs[SEQ_LENGTHS] = list(lengths)
    return kwargs


def tree_attention_kwargs(lengths: list[int], ancestors: list[list[int]]) -> dict[str, Any]:
    """Forward kwargs for a row laid out as a prefix tree (``rl_core.prefix_tree``): node
    ``i`` holds the next ``lengths[i]`` tokens and sees its ``ancestors[i]`` nodes' tokens."""
    return {TREE_NODES: (list(lengths), [list(a) for a in ancestors])}


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence; returns ``([1, T, H, D], None)``.

    Boundaries come from ``cu_seq_lens_q`` (see ``packed_attention_kwargs``), else from
    ``position_ids`` restarting at 0; with neither, the row is one sequence.
    """
    if attention_mask is not None:
        raise ValueError(
            f"{PACKED_ATTENTION} attention takes sequence boundaries, not a mask; "
            "pass packed_attention_kwargs(cu_seqlens) and no attention_mask"
        )
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError(
            f"{PACKED_ATTENTION} attention has no sliding window or logit soft-capping; "
            "load this model with attn_implementation='flash_attention_2'"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    if kwargs.get(TREE_NODES) is not None:
        lengths, ancestors = kwargs[TREE_NODES]
        return _tree_attention(query, key, value, lengths, ancestors, scaling, dropout), None
    cu = _boundaries(kwargs, query.shape[2], query.device)  # [S + 1]
    if _use_varlen_kernel(query):
        return _varlen_flash(query, key, value, cu, kwargs, scaling, dropout), None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: every query head gets its key/value head
        key = key.repeat_interleave(groups, dim=1)  # [1, H, T, D]
        value = value.repeat_interleave(groups, dim=1)  # [1, H, T, D]
    lengths = kwargs.get(SEQ_LENGTHS)
    if lengths is None:
        bounds = cu.tolist()
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    # split, not one slice per sequence: the backward of S slices would add S zero-padded
    # full-length gradients (O(S * T)); split's backward is one concatenation.
    outs = [
        F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling
        )  # [1, H, L, D]
        for q, k, v in zip(
            query.split(lengths, dim=2),
            key.split(lengths, dim=2),
            value.split(lengths, dim=2),
            strict=True,
        )
        if q.shape[2] > 0
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, T, D]
    return out.transpose(1, 2).contiguous(), None


def _tree_attention(
    query: torch.Tensor,  # [1, H, N, D]
    key: torch.Tensor,  # [1, Hkv, N, D]
    value: torch.Tensor,  # [1, Hkv, N, D]
    lengths: list[int],
    ancestors: list[list[int]],
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Attention along a prefix tree, one node at a time: ``[1, N, H, D]``.

    A node's queries attend to its ancestors' keys and, causally, its own: SDPA with the
    causal mask aligned to the lower right (query ``i`` of ``n`` sees the ``a`` ancestor
    keys and its node's first ``i + 1``; a plain boolean mask, which every SDPA backend,
    tensor mode and fake tensor takes), so memory per node is ``n x (a + n)``, as a flat
    sequence of that length costs, never ``N x N``. The row is split into nodes once, so the
    backward sums each node's key and value gradients over its descendants in node-sized
    tensors (not one row-sized gradient per child)."""
    groups = query.shape[1] // key.shape[1]
    queries = query.split(lengths, dim=2)
    keys, values = key.split(lengths, dim=2), value.split(lengths, dim=2)
    outs = []
    for node, (q, above) in enumerate(zip(queries, ancestors, strict=True)):
        k = torch.cat([keys[a] for a in above] + [keys[node]], dim=2) if above else keys[node]
        v = torch.cat([values[a] for a in above] + [values[node]], dim=2) if above else values[node]
        if groups > 1:  # grouped-query attention: every query head gets its key/value head
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        n, total = q.shape[2], k.shape[2]
        causal: dict[str, Any] = {"is_causal": True}
        if total > n:
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device)
            causal = {"attn_mask": mask.tril_(total - n)}  # [n, a + n]
        outs.append(
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, **causal)
        )  # [1, H, n, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, N, D]
    return out.transpose(1, 2).contiguous()


def _boundaries(kwargs: dict[str, Any], total: int, device: torch.device) -> torch.Tensor:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu
    pos = kwargs.get("position_ids")
    if pos is not None and pos.shape[-1] == total:
        starts = torch.nonzero(pos.reshape(-1) == 0).reshape(-1)  # [S]
        if starts.numel() and int(starts[0]) == 0:
            end = torch.tensor([total], device=starts.device)
            return torch.cat([starts, end]).to(torch.int32)
    return torch.tensor([0, total], dtype=torch.int32, device=device)


def _use_varlen_kernel(query: torch.Tensor) -> bool:
    if query.device.type != "cuda" or _varlen_attn() is None:
        return False
    return _compute_dtype(query) in (torch.bfloat16, torch.float16)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    # Under autocast the rotary step can leave query/key in float32 beside a bf16 value;
    # SDPA is on autocast's list, the varlen op is not, so cast by hand.
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return query.dtype


def _varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if "window_size" in params and "enable_gqa" in params else None


def _varlen_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    kwargs: dict[str, Any],
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    if dropout:
        raise NotImplementedError("the varlen flash kernel has no attention dropout")
    dtype = _compute_dtype(query)
    q, k, v = (
        x[0].transpose(0, 1).to(dtype).contiguous() for x in (query, key, value)
    )  # [T, H(kv), D]
    max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max().item())
    cu = cu.to(torch.int32)
    out = _varlen_attn()(
        q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0), enable_gqa=True
    )  # [T, H, D]
    return out[None]  # [1, T, H, D]


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None
