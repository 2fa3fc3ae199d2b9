import math

import pytest
import torch
from torch.testing import assert_close

from rl_core.config import RunConfig
from rl_core.loss import LossConfig, kl_penalty, ppo_loss

LN = math.log


DEFAULT = LossConfig()


def _call(theta, adv, cfg=DEFAULT, prox=None, behav=None, mask=None, **kw):
    theta = torch.tensor(theta, requires_grad=True)
    prox = theta.detach().clone() if prox is None else torch.tensor(prox)
    behav = prox.clone() if behav is None else torch.tensor(behav)
    mask = torch.ones_like(theta) if mask is None else torch.tensor(mask, dtype=torch.float32)
    loss, stats = ppo_loss(theta, prox, behav, torch.tensor(adv), mask, cfg, **kw)
    return theta, loss, stats


def test_loss_config_is_built_from_run_config():
    cfg = LossConfig.from_run_config(
        RunConfig(base_model="m", eps_clip=0.3, dual_clip=3.0, ratio_level="sequence")
    )
    assert (cfg.eps_clip, cfg.dual_clip, cfg.ratio_level, cfg.behav_imp_weight_cap) == (
        0.3,
        3.0,
        "sequence",
        5.0,
    )


def test_clipped_surrogate_matches_hand_computed_values():
    # ratios 1.5, 0.5, 1.1, 1.0 with advantages 1, -1, 2, 1 and eps 0.2:
    # min(1.5, 1.2)=1.2 ; min(-0.5, -0.8)=-0.8 ; min(2.2, 2.2)=2.2 ; 1.0
    _, loss, stats = _call([LN(1.5), LN(0.5), LN(1.1), 0.0], [1.0, -1.0, 2.0, 1.0], prox=[0.0] * 4)
    assert_close(loss, torch.tensor((-1.2 + 0.8 - 2.2 - 1.0) / 4))
    assert stats["ppo/clip_frac"] == pytest.approx(0.5)
    assert stats["ppo/behav_imp_weight"] == pytest.approx(1.0)
    # approx_kl is k3 of KL(p || θ): mean over tokens of (r - 1) - log r
    expected_kl = sum((r - 1) - LN(r) for r in (1.5, 0.5, 1.1, 1.0)) / 4
    assert stats["ppo/approx_kl"] == pytest.approx(expected_kl)


def test_clip_higher_widens_only_the_upper_bound():
    cfg = LossConfig(eps_clip=0.2, eps_clip_higher=0.28)
    _, loss, _ = _call([LN(1.5), LN(0.5)], [1.0, -1.0], cfg, prox=[0.0, 0.0])
    assert_close(loss, torch.tensor((-1.28 + 0.8) / 2))


def test_dual_clip_bounds_the_loss_of_a_large_ratio_on_a_negative_advantage():
    # r = 5, A = -1: PPO loss -min(-5, -1.2) = 5; dual clip c = 3 caps it at -c*A = 3.
    _, plain, _ = _call([LN(5.0)], [-1.0], prox=[0.0])
    theta, loss, stats = _call([LN(5.0)], [-1.0], LossConfig(dual_clip=3.0), prox=[0.0])
    assert_close(plain, torch.tensor(5.0))
    assert_close(loss, torch.tensor(3.0))
    assert stats["ppo/dual_clip_frac"] == 1.0
    loss.backward()
    assert_close(theta.grad, torch.zeros(1))  # the bound is a constant


def test_behaviour_importance_weight_scales_and_the_cap_masks_tokens():
    # prox - behav = log 2 and log 8: weights 2 and 8; cap 5 masks the second token.
    theta, loss, stats = _call([0.0, 0.0], [1.0, 1.0], prox=[0.0, 0.0], behav=[-LN(2.0), -LN(8.0)])
    assert_close(loss, torch.tensor(-2.0 / 2))  # normalised by both loss-mask tokens, as AReaL does
    assert stats["ppo/behav_imp_weight"] == pytest.approx(5.0)
    assert stats["ppo/behav_imp_weight_max"] == pytest.approx(8.0)
    assert stats["ppo/behav_masked_frac"] == pytest.approx(0.5)
    loss.backward()
    assert_close(theta.grad, torch.tensor([-1.0, 0.0]))


def test_without_decoupling_the_behaviour_policy_is_the_proximal_one():
    cfg = LossConfig(use_decoupled_loss=False)
    # prox is ignored: r = exp(theta - behav) = 1.1 → loss -1.1·A
    _, loss, stats = _call([0.0], [1.0], cfg, prox=[5.0], behav=[-LN(1.1)])
    assert_close(loss, torch.tensor(-1.1))
    assert stats["ppo/behav_imp_weight"] == 1.0


def test_on_policy_gradient_equals_the_vanilla_policy_gradient():
    torch.manual_seed(0)
    theta = torch.randn(2, 6, requires_grad=True)
    adv = torch.randn(2, 6)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float32)
    loss, _ = ppo_loss(theta, theta.detach(), theta.detach(), adv, mask, LossConfig())
    (grad,) = torch.autograd.grad(loss, theta)
    vanilla = -(adv * theta * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(vanilla, theta)
    assert_close(grad, expected)
    assert_close(loss, -(adv * mask).sum() / mask.sum())


def test_masked_tokens_contribute_nothing():
    theta, loss, stats = _call([LN(3.0), 0.0], [1.0, 2.0], prox=[0.0, 0.0], mask=[0.0, 1.0])
    assert_close(loss, torch.tensor(-2.0))
    loss.backward()
    assert theta.grad[0] == 0
    assert stats["ppo/n_tokens"] == 1.0


def test_sequence_level_ratio_is_the_geometric_mean_of_token_ratios():
    # Sequence 0: token ratios 1.1 and 1/1.1 → sequence ratio 1.
    # Sequence 1: ratios 1.5 and 1.5 → 1.5, clipped at 1.2 for A > 0.
    cfg = LossConfig(ratio_level="sequence")
    _, loss, stats = _call(
        [LN(1.1), -LN(1.1), LN(1.5), LN(1.5)],
        [1.0, 1.0, 1.0, 1.0],
        cfg,
        prox=[0.0] * 4,
        seq_ids=torch.tensor([0, 0, 1, 1]),
    )
    assert_close(loss, torch.tensor((-1.0 - 1.0 - 1.2 - 1.2) / 4))
    assert stats["ppo/clip_frac"] == pytest.approx(0.5)


def test_seq_mean_averages_each_sequence_first():
    # Sequence 0 has 1 token with loss -1, sequence 1 has 3 tokens with loss -3 each.
    cfg = LossConfig(loss_agg="seq_mean")
    _, loss, _ = _call(
        [0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 3.0], cfg, seq_ids=torch.tensor([0, 1, 1, 1])
    )
    assert_close(loss, torch.tensor((-1.0 - 3.0) / 2))
    _, token_mean, _ = _call([0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 3.0])
    assert_close(token_mean, torch.tensor(-10.0 / 4))


def test_packed_input_needs_seq_ids_for_sequence_options():
    with pytest.raises(ValueError, match="seq_ids"):
        _call([0.0], [1.0], LossConfig(loss_agg="seq_mean"))


def test_normalizer_lets_micro_batch_losses_add_up_to_the_minibatch_mean():
    theta = [LN(1.5), LN(0.5), LN(1.1), 0.0]
    adv = [1.0, -1.0, 2.0, 1.0]
    _, whole, _ = _call(theta, adv, prox=[0.0] * 4)
    _, first, _ = _call(theta[:1], adv[:1], prox=[0.0], normalizer=4)
    _, rest, _ = _call(theta[1:], adv[1:], prox=[0.0] * 3, normalizer=4)
    assert_close(first + rest, whole)


def test_kl_estimators_match_schulman():
    logp, ref = torch.tensor([LN(0.5), LN(0.2)]), torch.tensor([LN(0.25), LN(0.4)])
    assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([LN(2.0), LN(0.5)]))
    # k3 = (rho - 1) - log rho with rho = p_ref / p: rho = 0.5 and 2
    assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([-0.5 - LN(0.5), 1.0 - LN(2.0)]))


def test_kl_penalty_and_entropy_bonus_enter_the_loss():
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    # ratio 1, A = 0: only the penalty and the bonus remain. kl (k1) = 0 - log 0.5 = log 2.
    _, loss, stats = _call(
        [0.0, 0.0],
        [0.0, 0.0],
        cfg,
        ref_logprobs=torch.tensor([LN(0.5), LN(0.5)]),
        entropy=torch.tensor([2.0, 4.0]),
    )
    assert_close(loss, torch.tensor(0.1 * LN(2.0) - 0.01 * 3.0))
    assert stats["ppo/kl_ref"] == pytest.approx(LN(2.0))
    assert stats["ppo/entropy"] == pytest.approx(3.0)


def test_empty_mask_gives_a_zero_loss_that_still_backpropagates():
    theta, loss, stats = _call([1.0, 2.0], [1.0, 1.0], mask=[0.0, 0.0])
    loss.backward()
    assert loss.item() == 0.0
    assert_close(theta.grad, torch.zeros(2))
    assert stats == {"ppo/n_tokens": 0.0}
