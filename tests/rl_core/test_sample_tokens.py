"""The torch engine's batched sampler (rl_core/inference/torch_engine/sample.py): SGLang's
semantics per row, a row's token independent of the batch around it, seeds reproducible."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from rl_core.inference.torch_engine.protocol import GenerateRequest, SamplingParams
from rl_core.inference.torch_engine.sample import sample_tokens

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.3, -0.5, -1.0, -3.0, 0.9])
EOS = {7}


def _request(seed: int, **params) -> GenerateRequest:
    return GenerateRequest(
        rid=str(seed),
        input_ids=[1],
        params=SamplingParams(sampling_seed=seed, **params),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        return_text_in_logprobs=False,
        stream=False,
    )


def _expected(logits: torch.Tensor, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """The truncated distribution, computed the plain way: one token at a time."""
    scaled = logits / temperature
    ranked = scaled.argsort(descending=True).tolist()
    if 0 < top_k < len(logits):
        scaled[ranked[top_k:]] = -torch.inf
    probs = torch.softmax(scaled, 0)
    mass = 0.0
    for token in ranked:  # the smallest nucleus whose mass reaches top_p
        share = float(probs[token])
        if mass > top_p:
            probs[token] = 0.0
        mass += share
    probs[probs < min_p * probs.max()] = 0.0
    return probs / probs.sum()


def _frequencies(params: dict, draws: int = 20_000, batch: int = 500) -> torch.Tensor:
    counts = torch.zeros(len(LOGITS))
    for start in range(0, draws, batch):
        reqs = [_request(seed, **params) for seed in range(start, start + batch)]
        for token in sample_tokens(LOGITS.expand(batch, -1), reqs, EOS):
            counts[token] += 1
    return counts / draws


def test_sampled_frequencies_follow_temperature_top_k_top_p_and_min_p():
    for params in (
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 4},
        {"temperature": 0.9, "top_p": 0.8},
        {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "min_p": 0.2},
    ):
        frequencies = _frequencies(params)
        expected = _expected(LOGITS, **params)
        assert_close(frequencies, expected, atol=0.015, rtol=0, msg=str(params))
        # Tokens outside the truncation are never drawn, not merely rare.
        assert torch.all(frequencies[expected == 0] == 0), params


def test_a_rows_token_does_not_depend_on_the_rows_beside_it():
    alone = [
        sample_tokens(LOGITS[None], [_request(seed, temperature=0.8)], EOS)[0] for seed in range(64)
    ]
    others = torch.randn(5, len(LOGITS))
    mixed = []
    for seed in range(64):
        reqs = [
            _request(1000 + seed, temperature=0.0),  # greedy
            _request(seed, temperature=0.8),
            _request(2000 + seed, temperature=1.2, top_k=2, top_p=0.5),
            _request(3000 + seed, temperature=0.5, min_p=0.3),
        ]
        logits = torch.cat([others[:1], LOGITS[None], others[1:3]])
        mixed.append(sample_tokens(logits, reqs, EOS)[1])
    assert mixed == alone
    assert len(set(alone)) > 2  # sampled, not one token every time


def test_the_same_seed_gives_the_same_tokens_and_another_seed_other_tokens():
    def run(seed):
        req = _request(seed, temperature=1.0)
        return [sample_tokens(LOGITS[None], [req], EOS)[0] for _ in range(32)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_greedy_rows_take_the_argmax_and_min_new_tokens_hides_eos_and_stop_ids():
    logits = torch.tensor(
        [[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0], [0.0, 1.0, 0.0, 4.0, 0.0, 0.0, 0.0, 5.0]]
    )
    greedy = [_request(1, temperature=0.0), _request(2, temperature=0.0)]
    assert sample_tokens(logits, greedy, EOS) == [7, 7]
    held = [
        _request(1, temperature=0.0, min_new_tokens=2),
        _request(2, temperature=0.0, min_new_tokens=2, stop_token_ids=[3]),
    ]
    assert sample_tokens(logits, held, EOS) == [1, 1]
    held[0].output_ids = [4, 4]  # min_new_tokens reached: EOS is allowed again
    assert sample_tokens(logits, held, EOS) == [7, 1]
    ignoring = [_request(1, temperature=0.0, min_new_tokens=2, ignore_eos=True)]
    assert sample_tokens(logits[:1], ignoring, EOS) == [7]


def test_a_seed_draws_what_torch_multinomial_draws_from_the_same_distribution():
    """The batched draw is multinomial's own: a sampling_seed keeps its answers across the
    change from one multinomial call per row."""
    for params in ({"temperature": 0.9}, {"temperature": 1.1, "top_k": 5, "top_p": 0.9}):
        expected = _expected(LOGITS, **params)
        for seed in range(40):
            generator = torch.Generator().manual_seed(seed)
            draws = [int(torch.multinomial(expected, 1, generator=generator)) for _ in range(4)]
            req = _request(seed, **params)
            assert [sample_tokens(LOGITS[None], [req], EOS)[0] for _ in range(4)] == draws
