import logging
import math

import pytest
import torch
from torch.testing import assert_close

from rl_core.advantages import compute_advantages, grpo, reinforce_pp, rloo, token_advantages
from rl_core.types import Trajectory


def test_grpo_normalises_within_each_group():
    adv = grpo(torch.tensor([1.0, 0.0, 2.0, 4.0, 6.0]), ["a", "a", "b", "b", "b"], eps=0.0)
    # a: mean 0.5, sample std sqrt(0.5) ; b: mean 4, sample std 2
    assert_close(adv, torch.tensor([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), -1.0, 0.0, 1.0]))


def test_rloo_subtracts_the_mean_of_the_other_group_members():
    adv = rloo(torch.tensor([1.0, 0.0, 2.0, 4.0, 6.0]), ["a", "a", "b", "b", "b"])
    assert_close(adv, torch.tensor([1.0, -1.0, 2.0 - 5.0, 4.0 - 4.0, 6.0 - 3.0]))


def test_reinforce_pp_normalises_over_the_batch():
    adv = reinforce_pp(torch.tensor([1.0, 0.0, 2.0, 4.0, 6.0]), eps=0.0)
    # mean 2.6; squared deviations sum to 23.2, sample variance 5.8
    expected = (torch.tensor([1.0, 0.0, 2.0, 4.0, 6.0]) - 2.6) / math.sqrt(5.8)
    assert_close(adv, expected)


def test_grpo_groups_of_one_fall_back_to_the_batch_baseline():
    adv, stats = compute_advantages([1.0, 3.0, 5.0, 7.0], ["a", "a", "", "c"], "grpo", eps=0.0)
    # group a: mean 2, std sqrt(2); singletons: batch mean 4, batch sample std sqrt(20/3)
    batch_std = math.sqrt(20 / 3)
    assert_close(
        adv, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2), 1 / batch_std, 3 / batch_std])
    )
    assert stats["advantages/singleton_frac"] == 0.5


def test_rloo_groups_of_one_fall_back_to_the_batch_leave_one_out_baseline():
    adv, _ = compute_advantages([1.0, 3.0, 5.0, 7.0], ["a", "a", "", ""], "rloo")
    assert_close(adv, torch.tensor([-2.0, 2.0, 5.0 - 11 / 3, 7.0 - 3.0]))


def test_all_zero_advantages_warn_and_are_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="rl_core.advantages"):
        adv, stats = compute_advantages([1.0, 1.0, 0.0, 0.0], ["a", "a", "b", "b"], "grpo")
    assert_close(adv, torch.zeros(4))
    assert stats["advantages/all_zero"] == 1.0
    assert "trains nothing" in caplog.text


def test_informative_rewards_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="rl_core.advantages"):
        _, stats = compute_advantages([1.0, 0.0], ["a", "a"], "grpo")
    assert stats["advantages/all_zero"] == 0.0
    assert caplog.text == ""


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="auto"):
        compute_advantages([1.0], [""], "auto")


def _two_turn(rewards, group_id="g"):
    # prompt, turn 0 (2 tokens), a tool/user token, turn 1 (3 tokens)
    mask = [0, 0, 1, 1, 0, 1, 1, 1]
    return Trajectory(
        input_ids=list(range(8)),
        loss_mask=mask,
        logprobs=[0.0] * 8,
        versions=[0 if m else -1 for m in mask],
        rewards=rewards,
        group_id=group_id,
    )


def _one_turn(reward, group_id="g"):
    return Trajectory(
        [1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -1.0, -1.0], [-1, -1, 0, 0], [reward], group_id
    )


def test_later_turn_rewards_are_discounted_to_earlier_turns():
    traj = _two_turn([1.0, 4.0])
    assert traj.turn_spans() == [(0, 4), (4, 8)]
    assert traj.returns(0.5) == [1.0 + 0.5 * 4.0, 4.0]
    assert traj.reward(0.5) == 3.0
    assert traj.reward() == 5.0


def test_multi_turn_token_advantages_use_each_turns_return_on_assistant_tokens_only():
    advs, _ = token_advantages([_two_turn([1.0, 4.0]), _one_turn(1.0)], "rloo", turn_discount=0.5)
    # RLOO baselines: the other trajectory's episode reward (1.0 and 3.0).
    assert_close(advs[0], torch.tensor([0.0, 0.0, 2.0, 2.0, 0.0, 3.0, 3.0, 3.0]))
    assert_close(advs[1], torch.tensor([0.0, 0.0, -2.0, -2.0]))


def test_single_turn_token_advantages_match_episode_advantages():
    trajs = [_one_turn(r, g) for r, g in [(1.0, "a"), (0.0, "a"), (0.5, ""), (2.0, "")]]
    advs, _ = token_advantages(trajs, "grpo")
    episode, _ = compute_advantages([1.0, 0.0, 0.5, 2.0], ["a", "a", "", ""], "grpo")
    assert_close(torch.stack([a[2] for a in advs]), episode)
    assert all(a[0] == 0 and a[1] == 0 for a in advs)


def test_later_turn_signal_is_not_reported_as_all_zero(caplog):
    # Same episode reward (1 + 0 = 0 + 1), different turn returns.
    trajs = [_two_turn([1.0, 0.0]), _two_turn([0.0, 1.0])]
    with caplog.at_level(logging.WARNING):
        advs, stats = token_advantages(trajs, "rloo", turn_discount=1.0)
    assert_close(advs[0][5:], torch.full((3,), -1.0))
    assert stats["advantages/all_zero"] == 0.0
    assert caplog.text == ""


def test_turn_ends_split_adjacent_assistant_turns():
    traj = Trajectory(
        [1, 2, 3, 4, 5], [0, 1, 1, 1, 1], [0.0] * 5, [-1, 0, 0, 0, 0], [1.0, 2.0], turn_ends=[3, 5]
    )
    assert traj.turn_spans() == [(0, 3), (3, 5)]
    advs, _ = token_advantages([traj, _one_turn(0.0)], "rloo", turn_discount=1.0)
    assert_close(advs[0], torch.tensor([0.0, 3.0, 3.0, 2.0, 2.0]))


def test_turn_ends_must_cover_every_generated_token():
    with pytest.raises(ValueError, match="turn_ends"):
        Trajectory(
            [1, 2, 3, 4, 5], [0, 1, 1, 1, 1], [0.0] * 5, [-1, 0, 0, 0, 0], [1.0], turn_ends=[3]
        )


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(method):
    # 0.8 is not exact in binary: float32 rounding of the mean, divided by std + eps,
    # used to push every member by about -0.056.
    adv, _ = compute_advantages([0.8] * 8 + [0.0, 1.0], ["g"] * 8 + ["h", "h"], method)
    assert adv[:8].abs().max().item() == 0.0
    assert adv[8].item() < 0 < adv[9].item()


def test_equal_rewards_give_zero_token_advantages_too():
    from rl_core.types import Trajectory

    trajectories = [
        Trajectory(
            input_ids=[1, 2, 3],
            loss_mask=[0, 1, 1],
            logprobs=[0.0, -1.0, -1.0],
            versions=[-1, 0, 0],
            rewards=[0.8],
            group_id="g",
        )
        for _ in range(4)
    ]
    advantages, _ = token_advantages(trajectories, "grpo")
    assert all(a.abs().max().item() == 0.0 for a in advantages)
