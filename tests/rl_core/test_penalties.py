"""The torch engine's sampling penalties, against values computed by hand (SGLang's rules)."""

from __future__ import annotations

import torch

from rl_core.inference.torch_engine.penalties import apply_penalties, penalised
from rl_core.inference.torch_engine.protocol import SamplingParams


def test_frequency_and_presence_penalties_subtract_per_count_and_once_per_seen_token():
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [1, 1, 2], params)
    # token 1 seen twice: 2 - 2*0.5 - 0.25; token 2 once: -1 - 0.5 - 0.25; others untouched
    torch.testing.assert_close(out, torch.tensor([1.0, 0.75, -1.75, 0.5]))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5])
    out = apply_penalties(logits, [1, 2], SamplingParams(repetition_penalty=2.0))
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, -2.0, 0.5]))


def test_no_penalty_and_no_history_leave_the_logits_alone():
    logits = torch.tensor([1.0, 2.0])
    assert not penalised(SamplingParams())
    assert penalised(SamplingParams(repetition_penalty=1.1))
    assert apply_penalties(logits, [], SamplingParams(frequency_penalty=1.0)) is logits
