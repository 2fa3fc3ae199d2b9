"""Prefill: the prompts admitted in one scheduler step run as one forward pass.

The prompts are right-padded to the longest: a real token attends only to the tokens
before it, all real, and a padding position still sees its row's real tokens, so no
attention row is fully masked (a fully masked row is NaN in SDPA, and NaN times a zero
weight would leak into real rows). Each row keeps its own positions (0, 1, ...) and its
cache is cut to its real length when it joins the running batch (``kv_cache.join``).

A step used to prefill each new prompt alone: on a CPU one small forward costs about
what a decode step does, so a batch's requests that finished together (the same
``max_new_tokens``) made their successors wait one forward each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_core.hf import cache_kwargs, returned_cache
from rl_core.inference.torch_engine.kv_cache import make_cache
from rl_core.inference.torch_engine.protocol import GenerateRequest

MAX_PREFILL_TOKENS = 16384  # SGLang's --max-prefill-tokens default: padded tokens per forward


@dataclass
class Prefilled:
    """One prefill forward: per row, the logits after its last prompt token and its cache."""

    last_logits: torch.Tensor  # [B, V] float
    cache: Any  # right-padded: row i is real for its first lengths[i] positions
    lengths: list[int]
    input_logprobs: list[list[tuple[float | None, int]] | None]  # where a request asked
    # SGLang's input_top_logprobs where a request asked (top_logprobs_num): one row per input
    # token from logprob_start_len on, None for the first
    input_top: list[list[list[tuple[float, int]] | None] | None] = field(default_factory=list)


def wants_input_logprobs(req: GenerateRequest) -> bool:
    return 0 <= req.logprob_start_len < len(req.input_ids)


def chunks(reqs: list[GenerateRequest], max_tokens: int) -> Iterator[list[GenerateRequest]]:
    """``reqs`` in order, in groups whose padded size (rows × longest) fits ``max_tokens``; a
    prompt longer than that goes alone."""
    group: list[GenerateRequest] = []
    width = 0
    for req in reqs:
        longest = max(width, len(req.input_ids))
        if group and longest * (len(group) + 1) > max_tokens:
            yield group
            group, longest = [], len(req.input_ids)
        group.append(req)
        width = longest
    if group:
        yield group


def prefill(model: Any, reqs: list[GenerateRequest], device: torch.device) -> Prefilled:
    """Run ``reqs``' prompts through ``model`` together (no request is changed)."""
    lengths = [len(r.input_ids) for r in reqs]
    width = max(lengths)
    ids = torch.tensor(
        [r.input_ids + [0] * (width - len(r.input_ids)) for r in reqs], device=device
    )
    positions = torch.arange(width, device=device)[None].expand(len(reqs), -1)
    kwargs: dict[str, Any] = {}
    if min(lengths) < width:
        real = torch.tensor(lengths, device=device)[:, None]
        kwargs["attention_mask"] = (positions < real).long()
    if any(wants_input_logprobs(r) for r in reqs):
        keep: int | torch.Tensor = 0  # every position
        columns = [n - 1 for n in lengths]
    else:  # only each row's last position
        ends = sorted(set(lengths))
        keep = torch.tensor([n - 1 for n in ends], device=device)
        columns = [ends.index(n) for n in lengths]
    out = model(
        input_ids=ids,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=keep,
        **cache_kwargs(model, make_cache([])),
        **kwargs,
    )
    logits = out.logits.float()  # [B, kept, V]
    rows = torch.arange(len(reqs), device=logits.device)
    last = logits[rows, torch.tensor(columns, device=logits.device)]
    scored = [
        _input_logprobs(logits[i, : lengths[i]], req) if wants_input_logprobs(req) else (None, None)
        for i, req in enumerate(reqs)
    ]
    return Prefilled(
        last, returned_cache(out), lengths, [s[0] for s in scored], [s[1] for s in scored]
    )


def _input_logprobs(
    logits: torch.Tensor, req: GenerateRequest
) -> tuple[list[tuple[float | None, int]], list[list[tuple[float, int]] | None] | None]:
    """SGLang's ``input_token_logprobs`` from ``logprob_start_len`` on (the first is None), and
    its ``input_top_logprobs`` where ``top_logprobs_num`` asks (best first; None for the first)."""
    logprobs = torch.log_softmax(logits[:-1], dim=-1)  # [L-1, V]: row i predicts token i + 1
    targets = torch.tensor(req.input_ids[1:], device=logits.device)
    picked = logprobs.gather(-1, targets[:, None])[:, 0].tolist()
    positions = range(req.logprob_start_len, len(req.input_ids))
    own = [(None if i == 0 else picked[i - 1], req.input_ids[i]) for i in positions]
    if not req.top_logprobs_num:
        return own, None
    top = logprobs.topk(min(req.top_logprobs_num, logprobs.shape[-1]), dim=-1)  # [L-1, k] each
    values, ids = top.values.tolist(), top.indices.tolist()
    rows = [
        None if i == 0 else list(zip(values[i - 1], ids[i - 1], strict=True)) for i in positions
    ]
    return own, rows
