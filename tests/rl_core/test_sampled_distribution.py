"""Logprobs of the distribution actually sampled, from the torch engine through a Trajectory
into the trainer (rl_core.sampling): log_softmax(logits / T) on both sides, per token."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.testing import assert_close

from rl_core.config import RunConfig
from rl_core.inference.client import InferenceClient
from rl_core.packing import pack, packed_logprobs
from rl_core.rollout import Episode
from rl_core.sampling import TurnSampling, logprob_temperature
from rl_core.trainer import PPOTrainer
from rl_core.types import Trajectory

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "


async def _episodes(url: str, params: dict[str, Any], n: int = 4) -> list[Episode]:
    """``n`` answers sampled by the engine, as the rollout driver records them."""
    episodes = []
    async with InferenceClient(url) as client:
        for seed in range(n):
            sampling = {"max_new_tokens": 8, "ignore_eos": True, **params, "sampling_seed": seed}
            result = await client.generate(PROMPT, sampling)
            episodes.append(
                Episode(
                    input_ids=list(PROMPT),
                    output_ids=result.output_ids,
                    logprobs=result.output_logprobs,
                    versions=result.versions,
                    reward=float(seed % 2),
                    finish_reason=result.finish_reason,
                    text=result.text,
                    messages=[],
                    group_id="g",
                    sampling=sampling,
                )
            )
    return episodes


def _trajectory(episode: Episode) -> Trajectory:
    # Through the JSON the web app and the Ray job exchange, as in a real run.
    return Trajectory.from_dict(episode.to_trajectory().to_dict())


def _trainer(model_dir) -> PPOTrainer:
    cfg = RunConfig.from_dict(
        {
            "base_model": str(model_dir),
            "reward": {"type": "exact_match"},
            "batch_size": 4,
            "group_size": 2,
            "learning_rate": 1e-3,
            "entropy_coef": 0.01,  # the entropy term runs at each token's temperature too
        }
    )
    return PPOTrainer(cfg)


@pytest.mark.parametrize("temperature", [0.5, 1.5])
async def test_recorded_logprobs_are_log_softmax_of_logits_over_temperature(
    torch_engine, tiny_model_dir, reference, temperature
):
    episodes = await _episodes(torch_engine.url, {"temperature": temperature}, n=2)
    for episode in episodes:
        traj = _trajectory(episode)
        assert traj.temperatures == [1.0] * len(PROMPT) + [temperature] * len(episode.output_ids)
        expected = reference.logprobs(tiny_model_dir, PROMPT, episode.output_ids, temperature)
        behaviour = torch.tensor(traj.logprobs[len(PROMPT) :])
        assert_close(behaviour, expected, atol=2e-3, rtol=0)
        # Not the temperature-1 quantity: the test can tell the two apart.
        plain = reference.logprobs(tiny_model_dir, PROMPT, episode.output_ids)
        assert (behaviour - plain).abs().max() > 0.05
        # The trainer's packed recompute, each token at its own temperature, agrees.
        with torch.no_grad():
            recomputed, _ = packed_logprobs(reference.model(tiny_model_dir), pack([traj]))
        assert_close(recomputed[len(PROMPT) :], behaviour, atol=2e-3, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
async def test_behaviour_weight_is_one_for_on_policy_data_at_any_temperature(
    torch_engine, tiny_model_dir, temperature
):
    episodes = await _episodes(torch_engine.url, {"temperature": temperature})
    trainer = _trainer(tiny_model_dir)
    stats = trainer.train_step([_trajectory(e) for e in episodes])
    # w = exp(proximal - behaviour): the trainer's real path, packed micro-batches.
    assert stats["ppo/behav_imp_weight"] == pytest.approx(1.0, abs=2e-3)
    assert stats["ppo/behav_imp_weight_max"] == pytest.approx(1.0, abs=2e-3)
    assert stats["ppo/behav_masked_frac"] == 0.0


async def test_without_the_turn_temperature_the_behaviour_weight_is_off(
    torch_engine, tiny_model_dir
):
    """What the per-token temperature fixes: recomputing at 1 what was sampled at 0.5."""
    episodes = await _episodes(torch_engine.url, {"temperature": 0.5})
    trajectories = [_trajectory(e) for e in episodes]
    for traj in trajectories:
        traj.temperatures = None
    stats = _trainer(tiny_model_dir).train_step(trajectories)
    assert stats["ppo/behav_imp_weight_max"] > 1.5  # on-policy data, yet far from 1


async def test_greedy_tokens_are_recorded_at_temperature_one(
    torch_engine, tiny_model_dir, reference
):
    (episode,) = await _episodes(torch_engine.url, {"temperature": 0.0}, n=1)
    traj = _trajectory(episode)
    assert logprob_temperature(0.0) == 1.0
    assert traj.temperatures is None  # every token at 1.0
    expected = reference.logprobs(tiny_model_dir, PROMPT, episode.output_ids)
    assert_close(torch.tensor(traj.logprobs[len(PROMPT) :]), expected, atol=2e-3, rtol=0)


async def test_top_k_and_top_p_sample_the_truncated_distribution_but_record_the_full_tempered_one(
    torch_engine, tiny_model_dir, reference
):
    """The chosen behaviour (rl_core.sampling): tokens come from the kept set; the logprob is
    of the full tempered distribution (as SGLang reports it) and the trainer recomputes that,
    so the behaviour weight is 1 on-policy; the bias is log Z per token, documented."""
    temperature, top_k = 0.7, 3
    params = {"temperature": temperature, "top_k": top_k, "top_p": 0.9, "max_new_tokens": 16}
    episodes = await _episodes(torch_engine.url, params)
    assert TurnSampling.from_params(params).truncated
    model = reference.model(tiny_model_dir)
    kept_mass = []
    for episode in episodes:
        ids = torch.tensor([PROMPT + episode.output_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1] / temperature  # [n, V]
        full = torch.log_softmax(logits, dim=-1)  # [n, V]
        top = full.topk(top_k, dim=-1)
        out = torch.tensor(episode.output_ids)
        assert (top.indices == out[:, None]).any(-1).all()  # sampled inside the top-k
        picked = full.gather(-1, out[:, None])[:, 0]
        assert_close(torch.tensor(episode.logprobs), picked, atol=2e-3, rtol=0)
        kept_mass.append(top.values.exp().sum(-1))
    # The renormalised logprob would differ by -log Z: visible on this model, so the
    # assertion above really tells "full" from "truncated".
    assert torch.cat(kept_mass).min() < 0.95
    stats = _trainer(tiny_model_dir).train_step([_trajectory(e) for e in episodes])
    assert stats["ppo/behav_imp_weight_max"] == pytest.approx(1.0, abs=2e-3)
