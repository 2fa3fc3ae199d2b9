"""One sampled token per batch row: the rows' distributions computed together, in tensor ops.

SGLang's sampler, row by row: ``min_new_tokens`` hides the EOS and stop ids; a temperature
below ``SAMPLING_EPS`` is greedy; otherwise logits / T, then top-k, then top-p (the smallest
nucleus whose mass reaches p), then min-p (relative to the most likely token), and one draw
from the request's own generator, so a ``sampling_seed`` reproduces its answer. The
distributions of all rows are computed together and drawn from together, each row's noise
from its own generator (the same draw, for the same seed and distribution, as a
``torch.multinomial`` call per row), so a row's token never depends on the other rows.

The rows used to be sampled one at a time (a softmax, sort and multinomial each): a Python
round of ops per row and step, the largest cost of a decode step after the model itself
when many requests share the batch on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from rl_core.inference.torch_engine.protocol import GenerateRequest
from rl_core.sampling import SAMPLING_EPS, outside_nucleus


def sample_tokens(
    logits: torch.Tensor, reqs: Sequence[GenerateRequest], eos_ids: Iterable[int]
) -> list[int]:
    """One token for each request from its row of ``logits`` [B, V] (CPU, float)."""
    logits = _hide_stops(logits, reqs, set(eos_ids))
    vocab = logits.shape[-1]
    greedy, plain, truncated = [], [], []
    for i, r in enumerate(reqs):
        p = r.params
        if p.temperature < SAMPLING_EPS:
            greedy.append(i)
        elif 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0:
            truncated.append(i)
        else:
            plain.append(i)
    tokens = [0] * len(reqs)
    for rows, pick in (
        (greedy, lambda x, _: x.argmax(dim=-1).tolist()),
        (plain, lambda x, rs: _draw(x, rs, truncate=False)),
        (truncated, lambda x, rs: _draw(x, rs, truncate=True)),
    ):
        if rows:
            chosen = logits if len(rows) == len(reqs) else logits[rows]
            for i, token in zip(rows, pick(chosen, [reqs[i] for i in rows]), strict=True):
                tokens[i] = token
    return tokens


def _hide_stops(
    logits: torch.Tensor, reqs: Sequence[GenerateRequest], eos: set[int]
) -> torch.Tensor:
    """``logits`` with EOS and stop ids at -inf in the rows still short of ``min_new_tokens``."""
    short = [
        i
        for i, r in enumerate(reqs)
        if len(r.output_ids) < r.params.min_new_tokens and not r.params.ignore_eos
    ]
    if not short:
        return logits
    logits = logits.clone()
    for i in short:
        logits[i, list(eos | set(reqs[i].params.stop_token_ids))] = float("-inf")
    return logits


def _draw(logits: torch.Tensor, reqs: list[GenerateRequest], *, truncate: bool) -> list[int]:
    """Sample each row of ``logits`` [N, V] under its request's temperature (and truncation:
    only rows that ask for it are sorted, so a row's token never depends on its neighbours)."""
    vocab = logits.shape[-1]
    temps = torch.tensor([[r.params.temperature] for r in reqs], dtype=logits.dtype)
    scaled = logits / temps
    order = None
    if truncate:  # in descending order, where top-k, top-p and min-p are prefixes
        scaled, order = torch.sort(scaled, dim=-1, descending=True)
        keep = torch.tensor(
            [[r.params.top_k if 0 < r.params.top_k < vocab else vocab] for r in reqs]
        )
        scaled = scaled.masked_fill(torch.arange(vocab)[None] >= keep, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if truncate:
        top_p = torch.tensor(
            [[r.params.top_p if r.params.top_p < 1.0 else float("inf")] for r in reqs],
            dtype=probs.dtype,
        )
        probs = probs.masked_fill(outside_nucleus(probs, top_p), 0.0)
        min_p = torch.tensor([[r.params.min_p] for r in reqs], dtype=probs.dtype)
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    if order is not None:  # back to vocabulary order: a seed draws what it drew before
        probs = torch.zeros_like(probs).scatter_(-1, order, probs)
    # torch.multinomial's own single draw (its exponential trick: the argmax of p / E with
    # E ~ Exp(1) per token), the noise from each row's own generator: a seed draws exactly
    # what one multinomial call per row drew, for a third of the work per row.
    noise = torch.empty_like(probs)
    for i, r in enumerate(reqs):
        noise[i].exponential_(1.0, generator=r.generator)
    return (probs / noise).argmax(dim=-1).tolist()
