"""The torch engine's prefix cache: a finished request's KV, reused by the next request that
begins with the same tokens.

An agent's next turn is its last prompt, the answer it got, and what it added; a group of
samples shares its prompt. Without a cache every turn prefills the whole conversation again, so
a turn's cost grows with the session (issue 36: turns 121-128 of a session took 10.7x turns
1-8). SGLang keeps a radix tree of KV pages and vLLM hashes KV blocks; this engine keeps whole
sequences: when a request finishes, the keys and values of the tokens it fed (its prompt and its
answer but the last token, which no forward saw) are cut out of the running batch and kept
under those token ids. A new request takes the entry with the longest common prefix (at least
``min_reuse`` tokens) and prefills only what follows it (``prefill_continued``), one forward
with the entry's KV as the past, at the positions the tokens really have: what it computes
equals a full prefill, up to the order of floating-point sums.

Entries are per adapter (a LoRA adapter's KV is not the base model's), held least recently used
first out within ``max_bytes`` of KV, and an entry another one extends (the turn before it) is
dropped for it. New weights make every entry stale: ``clear`` empties the cache on each weight
update, as SGLang flushes its own, and a request that ran across an update leaves nothing
behind (``epoch``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.hf import cache_kwargs, returned_cache
from rl_core.inference.torch_engine.kv_cache import KV, PaddedBatchCache, make_cache
from rl_core.inference.torch_engine.prefill import Prefilled
from rl_core.inference.torch_engine.protocol import GenerateRequest

DEFAULT_MAX_MB = 1024  # KV held, MiB (--prefix-cache-mb): ~18k tokens of a 7B model in bf16
MIN_REUSE = 16  # a shorter common prefix is prefilled again: one forward either way


@dataclass
class Entry:
    ids: list[int]
    kv: KV  # per layer (keys, values), each [1, H_kv, len(ids), D], owned by the cache
    nbytes: int


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (list slices compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


class PrefixCache:
    """Finished sequences' KV by adapter and token ids; used by the scheduler thread only."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_MB << 20, min_reuse: int = MIN_REUSE):
        self.max_bytes = max_bytes
        self.min_reuse = max(1, min_reuse)
        self._entries: OrderedDict[int, tuple[str | None, Entry]] = OrderedDict()
        self._next = 0
        self.tokens = 0  # held
        self.bytes = 0
        self.epoch = 0  # bumped by clear: KV computed before it is never kept
        self.hits = 0
        self.cached_tokens = 0  # prompt tokens served from the cache, all requests

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = self.bytes = 0
        self.epoch += 1

    def forget(self, adapter: str | None) -> None:
        """Drop the entries of one adapter (unloaded: its name may come back with other weights)."""
        for key in [k for k, (a, _) in self._entries.items() if a == adapter]:
            self._drop(key)

    def match(self, adapter: str | None, ids: list[int]) -> tuple[int, KV] | None:
        """The longest cached prefix of ``ids`` under ``adapter``, at most ``len(ids) - 1``
        tokens (the last prompt token is always computed: its logits pick the first output),
        as ``(length, kv)``; None below ``min_reuse`` tokens."""
        best, best_key, best_entry = 0, None, None
        for key, (owner, entry) in self._entries.items():
            if owner != adapter or len(entry.ids) <= best or entry.ids[0] != ids[0]:
                continue
            n = common_prefix(entry.ids, ids)
            if n > best:
                best, best_key, best_entry = n, key, entry
        length = min(best, len(ids) - 1)
        if best_key is None or best_entry is None or length < self.min_reuse:
            return None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.cached_tokens += length
        return length, [(k[:, :, :length], v[:, :, :length]) for k, v in best_entry.kv]

    def put(self, adapter: str | None, ids: list[int], kv: KV) -> None:
        """Keep ``kv`` (one row, ``len(ids)`` positions; the caller's copy) under ``ids``;
        entries ``ids`` extends go, then the least recently used until it fits."""
        size = sum(k.nbytes + v.nbytes for k, v in kv)
        if len(ids) < self.min_reuse or size > self.max_bytes:
            return
        for key in [
            k
            for k, (owner, entry) in self._entries.items()
            if owner == adapter
            and len(entry.ids) <= len(ids)
            and ids[: len(entry.ids)] == entry.ids
        ]:
            self._drop(key)
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = (adapter, Entry(ids, kv, size))
        self._next += 1
        self.tokens += len(ids)
        self.bytes += size

    def keep_rows(self, batch: PaddedBatchCache, reqs: list[GenerateRequest], rows: list[int]):
        """Keep the KV of the finished ``rows`` of the running batch (``reqs[i]`` is row i):
        the tokens each fed, unless it ran across a weight update."""
        if batch.kv is None or batch.mask is None:
            return
        lengths = batch.mask.sum(dim=1).tolist()
        for row in rows:
            req = reqs[row]
            if req.cache_epoch != self.epoch:
                continue
            length = int(lengths[row])
            ids = (req.input_ids + req.output_ids)[:length]
            self.put(req.lora_path, ids, row_kv(batch.kv, row, length))

    def _drop(self, key: int) -> None:
        _, entry = self._entries.pop(key)
        self.tokens -= len(entry.ids)
        self.bytes -= entry.nbytes

    def stats(self) -> dict[str, int]:
        return {
            "prefix_cache_entries": len(self._entries),
            "prefix_cache_tokens": self.tokens,
            "prefix_cache_bytes": self.bytes,
            "num_prefix_cache_hits": self.hits,
            "num_cached_prompt_tokens": self.cached_tokens,
        }


def row_kv(kv: KV, row: int, length: int) -> KV:
    """Row ``row``'s last ``length`` positions of a left-padded batch cache, copied (the batch's
    tensors are cut and regrown, and a view would keep the whole batch alive)."""
    return [
        (
            k[row : row + 1, :, k.shape[2] - length :].clone(),
            v[row : row + 1, :, v.shape[2] - length :].clone(),
        )
        for k, v in kv
    ]


def prefill_continued(
    model: Any, req: GenerateRequest, past: KV, device: torch.device
) -> Prefilled:
    """Prefill ``req``'s prompt after its first ``len(past)`` tokens, whose KV ``past`` holds."""
    start = past[0][0].shape[2]
    rest = torch.tensor([req.input_ids[start:]], device=device)
    positions = torch.arange(start, len(req.input_ids), device=device)[None]
    out = model(
        input_ids=rest,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **cache_kwargs(model, make_cache(list(past))),
    )
    return Prefilled(out.logits[:, -1].float(), returned_cache(out), [len(req.input_ids)], [None])
