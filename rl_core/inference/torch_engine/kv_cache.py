"""The running batch's KV cache: one left-padded tensor per layer, grown and shrunk in place.

New requests are prefilled together, right-padded (prefill.py), and each then
joins the batch as a new row, cut to its real length and left-padded to the batch's. A
decode step feeds every row one token; finished rows are dropped, and so is any
left padding no remaining row needs.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_core.hf import cache_kwargs, returned_cache

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each [B, H_kv, T, D]


def cache_tensors(cache: Any) -> KV:
    """Per-layer (keys, values) of a transformers DynamicCache, each ``[B, H_kv, T, D]``."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # older transformers


def make_cache(tensors: KV) -> Any:
    from transformers import DynamicCache

    return DynamicCache(tensors)


def _left_pad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class PaddedBatchCache:
    """KV cache rows of the running batch; row i belongs to the scheduler's i-th running request.

    ``mask`` [B, T] marks real (1) vs left-padding (0) positions. Padded positions
    are masked out of attention and each row's RoPE position is its own count of
    real tokens, so left padding changes nothing numerically.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.kv: KV | None = None
        self.mask: torch.Tensor | None = None  # [B, T] long

    def clear(self) -> None:
        self.kv, self.mask = None, None

    def join(self, cache: Any, lengths: list[int], rows: list[int]) -> None:
        """Append ``rows`` of a right-padded prefill's cache as batch rows; row i of it is
        real for its first ``lengths[i]`` positions."""
        kv = cache_tensors(cache)
        t_old = 0 if self.mask is None else self.mask.shape[1]
        t = max([t_old] + [lengths[i] for i in rows])

        def left_padded(x: torch.Tensor) -> torch.Tensor:  # [n, H, T, D] -> [rows, H, t, D]
            return torch.cat(
                [_left_pad(x[i : i + 1, :, : lengths[i]], t - lengths[i], 2) for i in rows]
            )

        new = [(left_padded(k), left_padded(v)) for k, v in kv]
        ones = torch.ones(1, t, dtype=torch.long, device=self.device)
        mask = torch.cat([_left_pad(ones[:, : lengths[i]], t - lengths[i], 1) for i in rows])
        if self.kv is None or self.mask is None:
            self.kv, self.mask = new, mask
            return
        self.kv = [
            (
                torch.cat([_left_pad(k0, t - t_old, 2), k1]),
                torch.cat([_left_pad(v0, t - t_old, 2), v1]),
            )
            for (k0, v0), (k1, v1) in zip(self.kv, new, strict=True)
        ]
        self.mask = torch.cat([_left_pad(self.mask, t - t_old, 1), mask])

    def decode(self, model: Any, last_tokens: torch.Tensor) -> torch.Tensor:
        """Run ``model`` on one new token per row (``last_tokens`` [B, 1]); return logits [B, V]."""
        assert self.kv is not None and self.mask is not None
        batch = last_tokens.shape[0]
        attention_mask = torch.cat([self.mask, self.mask.new_ones(batch, 1)], dim=1)  # [B, T+1]
        position_ids = self.mask.sum(dim=1, keepdim=True)  # [B, 1]
        out = model(
            input_ids=last_tokens,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **cache_kwargs(model, make_cache(self.kv)),
        )
        self.kv = cache_tensors(returned_cache(out))
        self.mask = attention_mask
        return out.logits[:, -1, :]

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in this order), then drop left padding that no kept row needs."""
        if not rows or self.kv is None or self.mask is None:
            self.clear()
            return
        index = torch.tensor(rows, device=self.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).nonzero()[0])
        self.mask = mask[:, first:]
        self.kv = [
            (k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:])
            for k, v in self.kv
        ]
