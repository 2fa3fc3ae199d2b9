import json

import pytest
import torch
from torch.testing import assert_close

from rl_core.attention import register_packed_attention
from rl_core.hf import load_causal_lm
from rl_core.packing import block_causal_mask, micro_batches, pack, packed_logprobs
from rl_core.types import Trajectory


def _traj(ids, n_prompt, reward=1.0, version=0):
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    return Trajectory(
        input_ids=ids,
        loss_mask=mask,
        logprobs=[-0.5 * m for m in mask],
        versions=[version if m else -1 for m in mask],
        rewards=[reward],
    )


# The trainer's padding-free attention, and the dense block mask (the benchmark's baseline).
@pytest.fixture(scope="module", params=["packed", "dense-sdpa", "dense-eager"])
def model(request, tiny_model_dir):
    attention = {"packed": register_packed_attention()}.get(request.param, request.param[6:])
    return load_causal_lm(tiny_model_dir, torch.float32, torch.device("cpu"), attention).eval()


def test_pack_concatenates_without_padding_and_restarts_positions():
    trajs = [_traj([5, 6, 7], 1), _traj([8, 9], 1), _traj([1, 2, 3, 4], 2)]
    batch = pack(
        trajs,
        [0, 2],
        extra={"adv": [torch.tensor([0.0, 1.0, 1.0]), None, torch.tensor([0.0, 0.0, 2.0, 2.0])]},
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert batch.cu_seqlens.tolist() == [0, 3, 7]
    assert batch.seq_ids.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert batch.loss_mask.tolist() == [False, True, True, False, False, True, True]
    assert batch.extra["adv"].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 2.0, 2.0]
    assert batch.indices == [0, 2]


def test_micro_batches_respect_the_token_budget():
    lengths = [5, 3, 8, 2, 7, 20]
    groups = micro_batches(lengths, max_tokens=10)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert sum(lengths[i] for i in g) <= 10 or len(g) == 1  # an oversize sequence rides alone
    # First-fit decreasing: [20], [8, 2], [7, 3], [5]
    assert groups == [[5], [2, 3], [1, 4], [0]]


def test_block_causal_mask_blocks_other_sequences_and_the_future():
    mask = block_causal_mask(torch.tensor([0, 2, 3], dtype=torch.int32), torch.float32)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]


def test_packed_logprobs_equal_unpacked_ones(model):
    g = torch.Generator().manual_seed(0)
    trajs = [_traj(torch.randint(0, 256, (n,), generator=g).tolist(), 2) for n in (7, 4, 11)]
    batch = pack(trajs)
    logprobs, entropy = packed_logprobs(model, batch, with_entropy=True)
    assert logprobs.shape == entropy.shape == (22,)
    for i, traj in enumerate(trajs):
        ids = torch.tensor([traj.input_ids])  # [1, L]
        logits = model(ids).logits[0]  # [L, V]
        logp = torch.log_softmax(logits[:-1], -1)  # [L-1, V]
        expected = torch.cat([torch.zeros(1), logp.gather(-1, ids[0, 1:, None])[:, 0]])  # [L]
        expected_entropy = torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)])  # [L]
        start, end = batch.cu_seqlens[i].item(), batch.cu_seqlens[i + 1].item()
        assert_close(logprobs[start:end], expected)
        assert_close(entropy[start:end], expected_entropy)


def test_temperature_scales_the_logits(model):
    batch = pack([_traj([1, 2, 3, 4, 5], 1)])
    logprobs, _ = packed_logprobs(model, batch, temperature=0.5)
    logits = model(batch.input_ids).logits[0, :-1] / 0.5  # [L-1, V]
    expected = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[0, 1:, None])[:, 0]
    assert_close(logprobs[1:], expected)


def test_each_token_is_scored_at_its_own_temperature_across_packed_sequences_and_chunks(model):
    g = torch.Generator().manual_seed(1)
    trajs = [_traj(torch.randint(0, 256, (n,), generator=g).tolist(), 2) for n in (6, 5, 7)]
    trajs[0].temperatures = [1.0] * 2 + [0.5] * 4
    trajs[2].temperatures = [1.0] * 2 + [0.5, 0.5, 1.5, 1.5, 1.5]  # two turns, two settings
    batch = pack(trajs)  # trajs[1] has None: 1.0 everywhere
    assert batch.temperatures is not None and batch.temperatures.shape == (18,)
    logprobs, entropy = packed_logprobs(model, batch, with_entropy=True, chunk_tokens=4)
    for i, traj in enumerate(trajs):
        ids = torch.tensor([traj.input_ids])  # [1, L]
        temps = torch.tensor(traj.temperatures or [1.0] * len(traj.input_ids))  # [L]
        logp = torch.log_softmax(model(ids).logits[0, :-1] / temps[1:, None], -1)  # [L-1, V]
        start, end = batch.cu_seqlens[i].item(), batch.cu_seqlens[i + 1].item()
        assert_close(logprobs[start + 1 : end], logp.gather(-1, ids[0, 1:, None])[:, 0])
        assert_close(entropy[start + 1 : end], -(logp.exp() * logp).sum(-1))


def test_a_batch_at_temperature_one_carries_no_temperatures():
    traj = _traj([1, 2, 3], 1)
    traj.temperatures = [1.0, 1.0, 1.0]
    assert pack([traj, _traj([4, 5], 1)]).temperatures is None


def test_packed_logprobs_carry_gradients(model):
    batch = pack([_traj([1, 2, 3], 1), _traj([4, 5, 6], 1)])
    logprobs, _ = packed_logprobs(model, batch)
    logprobs[batch.loss_mask].sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_trajectory_round_trips_through_json():
    traj = Trajectory(
        input_ids=[1, 2, 3, 4, 5],
        loss_mask=[0, 1, 0, 1, 1],
        logprobs=[0.0, -0.1, 0.0, -0.2, -0.3],
        versions=[-1, 3, -1, 4, 4],
        rewards=[0.5, 1.0],
        group_id="g",
        session_id="s",
        metadata={"k": "v"},
        temperatures=[1.0, 0.7, 1.0, 1.3, 1.3],
    )
    again = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert again == traj
    assert again.oldest_version == 3


def test_trajectory_accepts_a_single_final_reward():
    traj = Trajectory.from_dict(
        {
            "input_ids": [1, 2],
            "loss_mask": [0, 1],
            "logprobs": [0, -1],
            "versions": [-1, 0],
            "reward": 2,
        }
    )
    assert traj.rewards == [2.0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logprobs": [0.0]}, "logprobs has 1 entries"),
        ({"loss_mask": [0, 0, 0]}, "no generated tokens"),
        ({"loss_mask": [1, 1, 1]}, "first token"),
        ({"versions": [-1, -1, 0]}, "policy version"),
        ({"rewards": [1.0, 2.0]}, "1 assistant turns but 2 rewards"),
        ({"temperatures": [1.0, 1.0]}, "temperatures has 2 entries"),
        ({"temperatures": [1.0, 0.0, 1.0]}, "temperatures must all be > 0"),
    ],
)
def test_trajectory_validation_says_what_is_wrong(change, message):
    fields = {
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "logprobs": [0.0, -1.0, -1.0],
        "versions": [-1, 0, 0],
        "rewards": [1.0],
    }
    with pytest.raises(ValueError, match=message):
        Trajectory(**{**fields, **change})


def test_balanced_shards_give_each_rank_a_similar_token_count_deterministically():
    from rl_core.distributed import balanced_shards

    lengths = [13, 5, 11, 7, 9, 3]
    shards = balanced_shards(lengths, 2)
    # Longest first to the lighter rank: 13→0, 11→1, 9→1, 7→0, 5→0 (20 vs 20: rank 0), 3→1.
    assert shards == [[0, 1, 3], [2, 4, 5]]
    assert [sum(lengths[i] for i in s) for s in shards] == [25, 23]
    assert balanced_shards(lengths, 2) == shards
    assert sorted(i for s in balanced_shards(lengths, 4) for i in s) == list(range(6))
    assert balanced_shards([4], 3) == [[0], [], []]


def test_rank_micro_batches_report_the_busiest_ranks_count():
    from rl_core.distributed import rank_micro_batches

    lengths = [13, 12, 11]  # rank 0: [13]; rank 1: [12, 11], which a budget of 16 splits
    assert rank_micro_batches(lengths, 2, 0, 16) == ([[0]], 2)
    assert rank_micro_batches(lengths, 2, 1, 16) == ([[1], [2]], 2)
    assert rank_micro_batches(lengths, 1, 0, 16) == ([[0], [1], [2]], 3)
