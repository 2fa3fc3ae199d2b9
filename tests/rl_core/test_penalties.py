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


async def test_the_engine_reports_the_logprob_of_the_penalised_distribution_it_sampled(
    torch_engine, tiny_model_dir, reference
):
    from rl_core.inference import InferenceClient

    prompt = [72, 101, 108, 108, 111, 44, 32]
    params = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    async with InferenceClient(torch_engine.url) as client:
        result = await client.generate(
            prompt,
            {"max_new_tokens": 12, "temperature": 0.7, "sampling_seed": 4, **params},
        )
    ids = torch.tensor([prompt + result.output_ids])
    with torch.no_grad():
        logits = reference.model(tiny_model_dir)(ids).logits[0, len(prompt) - 1 : -1].float()
    expected = []
    sampling = SamplingParams(**params)
    for position, token in enumerate(result.output_ids):  # penalties, then temperature
        row = apply_penalties(logits[position], result.output_ids[:position], sampling)
        expected.append(torch.log_softmax(row / 0.7, dim=-1)[token])
    torch.testing.assert_close(
        torch.tensor(result.output_logprobs), torch.stack(expected), atol=1e-4, rtol=1e-4
    )
    # ... which is not what the trainer's unpenalised recomputation gives (the rule's reason)
    plain = reference.logprobs(tiny_model_dir, prompt, result.output_ids, temperature=0.7)
    assert not torch.allclose(torch.tensor(result.output_logprobs), plain, atol=1e-3)
