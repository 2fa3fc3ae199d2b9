"""SGLang's sampling penalties over the tokens a request has generated so far.

As SGLang's penalizers (``sglang/srt/sampling/penaltylib``), applied to the raw logits
before temperature, so the sampled distribution and the reported logprob are both of
the penalised logits:

- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's):
  ``logit[t] -= f · count(t) + p · [count(t) > 0]``;
- ``repetition_penalty`` r (CTRL, Keskar et al. 2019): for every token already
  generated, ``logit / r`` when positive, ``logit · r`` otherwise.
"""

from __future__ import annotations

import torch

from rl_core.inference.torch_engine.protocol import SamplingParams


def penalised(params: SamplingParams) -> bool:
    return bool(
        params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0
    )


def apply_penalties(
    logits: torch.Tensor, output_ids: list[int], params: SamplingParams
) -> torch.Tensor:
    """``logits`` [V] of one request with its penalties applied (a new tensor)."""
    if not output_ids:
        return logits
    counts = torch.bincount(torch.tensor(output_ids), minlength=logits.shape[-1])  # [V]
    counts = counts[: logits.shape[-1]].to(logits.dtype)
    out = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        scaled = torch.where(
            out > 0, out / params.repetition_penalty, out * params.repetition_penalty
        )
        out = torch.where(seen, scaled, out)
    return out
