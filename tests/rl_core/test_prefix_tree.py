"""Prefix-tree training (issue 37): each shared prefix computed once, the loss unchanged.

The tree's logprobs, loss and gradients equal flat packing's on random trees (float32,
1e-5), with and without per-token temperatures, for a full model and LoRA, in one process
and on two gloo workers; a branch never sees its sibling; nothing of size ``N x N`` is made.
"""

from __future__ import annotations

import datetime
import json
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rl_core import prefix_tree
from rl_core.attention import register_packed_attention, tree_attention_kwargs
from rl_core.config import RunConfig
from rl_core.distributed import tree_rank_micro_batches
from rl_core.loss import LossConfig, ppo_loss
from rl_core.packing import pack, packed_logprobs
from rl_core.trainer import PPOTrainer
from rl_core.types import Trajectory
from tests.rl_core.test_attention import _qwen2, _ShapeRecorder


def _tree_trajectories(seed: int, vocab: int, temperatures: bool) -> list[Trajectory]:
    """Random trees: a prompt, then up to three levels of branches of random fan-out, and
    some unrelated sequences beside them (a forest)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    seqs: list[tuple[list[int], int]] = []  # (ids, prompt length)

    def grow(prefix: list[int], depth: int, n_prompt: int) -> None:
        for _ in range(rng.randrange(1, 4)):
            ids = prefix + tokens(rng.randrange(1, 7))
            if depth < 3 and rng.random() < 0.6:
                grow(ids, depth + 1, n_prompt)
            else:
                seqs.append((ids, n_prompt))

    for _ in range(rng.randrange(1, 3)):
        prompt = tokens(rng.randrange(2, 20))
        grow(prompt, 1, len(prompt))
    seqs.append((tokens(rng.randrange(3, 9)), 2))
    seqs.append(list(seqs[0]))  # a duplicate: every token shared
    out = []
    for ids, n_prompt in seqs:
        mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
        traj = Trajectory(
            ids,
            mask,
            [-rng.random() * m for m in mask],
            [0 if m else -1 for m in mask],
            [rng.random()],
        )
        if temperatures:  # a sequence's answer at its own temperature
            traj.temperatures = [1.0] * n_prompt + [rng.choice((0.7, 1.0, 1.3))] * (
                len(ids) - n_prompt
            )
        out.append(traj)
    return out


def _loss(model, batch):
    logprobs, entropy = packed_logprobs(model, batch, with_entropy=True)
    loss, _ = ppo_loss(
        logprobs,
        batch.logprobs + 0.1,  # proximal a little off the behaviour: the weights differ per token
        batch.logprobs,
        batch.extra["advantages"],
        batch.loss_mask,
        LossConfig(entropy_coef=0.01),
        entropy=entropy,
        seq_ids=batch.seq_ids,
        normalizer=float(batch.loss_mask.sum()),
    )
    return logprobs, entropy, loss


def _step(model, trajs, tree: bool):
    advantages = [torch.randn(len(t.input_ids), generator=torch.Generator().manual_seed(i))
                  for i, t in enumerate(trajs)]  # fmt: skip
    batch = pack(trajs, extra={"advantages": advantages}, tree=tree)
    model.zero_grad(set_to_none=True)
    logprobs, entropy, loss = _loss(model, batch)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return batch, logprobs.detach(), entropy.detach(), loss.detach(), grads


def test_build_lays_each_distinct_prefix_out_once_and_maps_every_token_back():
    rng = random.Random(0)
    for _ in range(200):
        base = [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
        seqs = [
            base[: rng.randrange(len(base) + 1)]
            + [rng.randrange(3) for _ in range(rng.randrange(5))]
            or [1]
            for _ in range(rng.randrange(1, 7))
        ]
        tree = prefix_tree.build(seqs)
        flat = torch.tensor([x for s in seqs for x in s])
        assert torch.equal(tree.input_ids[0, tree.flat_index], flat)
        positions = torch.cat([torch.arange(len(s)) for s in seqs])
        assert torch.equal(tree.position_ids[0, tree.flat_index], positions)
        prefixes = {tuple(s[: k + 1]) for s in seqs for k in range(len(s))}
        assert tree.num_tokens == len(prefixes) == prefix_tree.tree_tokens(seqs)
        start = 0
        for s in seqs:  # each token's predecessor is the one before it in its sequence
            index = tree.flat_index[start : start + len(s)]
            assert tree.pred[index[0]] == -1
            assert torch.equal(tree.pred[index[1:]], index[:-1])
            start += len(s)
        assert sum(tree.lengths) == tree.num_tokens and tree.starts == sorted(tree.starts)
        for start_, ancestors in zip(tree.starts, tree.ancestors, strict=True):
            above = sum(tree.lengths[a] for a in ancestors)
            assert tree.position_ids[0, start_] == above  # a node begins where its ancestors end


@pytest.mark.parametrize("temperatures", [False, True], ids=["t1", "per-token-t"])
@pytest.mark.parametrize("arch", ["llama", "qwen2-gqa"])
def test_tree_logprobs_loss_and_gradients_equal_flat_packing(arch, temperatures, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    if arch == "llama":
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32, attn_implementation=register_packed_attention()
        )
    else:
        model = _qwen2(register_packed_attention())
    model.train()
    for seed in range(6):
        trajs = _tree_trajectories(seed, model.config.vocab_size, temperatures)
        flat = _step(model, trajs, tree=False)
        tree = _step(model, trajs, tree=True)
        assert flat[0].tree is None and tree[0].tree is not None
        assert tree[0].computed_tokens < flat[0].num_tokens  # shared prefixes ran once
        assert_close(tree[1], flat[1], atol=1e-5, rtol=1e-5)  # per-token logprobs
        assert_close(tree[2], flat[2], atol=1e-5, rtol=1e-5)  # entropies
        assert_close(tree[3], flat[3], atol=1e-5, rtol=1e-5)  # loss
        for got, want in zip(tree[4], flat[4], strict=True):
            assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_tokens_scored_at_different_temperatures_are_not_merged():
    trajs = _tree_trajectories(3, 300, temperatures=False)
    trajs = [trajs[0], Trajectory(**{**trajs[0].__dict__})]
    assert pack(trajs, tree=True).tree.num_tokens == len(
        trajs[0].input_ids
    )  # identical: all shared
    trajs[1].temperatures = [0.5] * len(trajs[1].input_ids)
    assert pack(trajs, tree=True).tree is None  # the same ids, other logprobs: nothing merges


def test_a_branch_never_sees_its_sibling():
    """Two answers to one prompt: each answer's logprobs in the tree equal those of its own
    sequence packed alone, and would not if the tree were read as one causal row (the
    second answer would see the first)."""
    model = _qwen2(register_packed_attention()).eval()
    prompt, first, second = [5, 17, 29, 41], [60, 61, 62], [70, 71, 72]
    trajs = [
        Trajectory(prompt + a, [0] * 4 + [1] * 3, [0.0] * 7, [-1] * 4 + [0] * 3, [0.0])
        for a in (first, second)
    ]
    batch = pack(trajs, tree=True)
    assert batch.tree.lengths == [4, 3, 3]  # the prompt, then each answer
    with torch.no_grad():
        in_tree, _ = packed_logprobs(model, batch)
        alone = [packed_logprobs(model, pack([t]))[0] for t in trajs]
        # The same tree tokens as one causal row: the second answer attends to the first.
        row = batch.tree
        leaky = (
            model(
                input_ids=row.input_ids,
                position_ids=row.position_ids,
                **tree_attention_kwargs([row.num_tokens], [[]]),
            )
            .logits[0]
            .log_softmax(-1)
        )  # [10, V]
    assert_close(in_tree, torch.cat(alone), atol=1e-6, rtol=1e-6)
    # Tree tokens 7-9 are the second answer: rows 7 and 8 predict its 71 and 72.
    leaked = leaky[[7, 8], [71, 72]]
    assert_close(in_tree[12:14], alone[1][5:7])  # flat: the second sequence's 71 and 72
    assert not torch.allclose(leaked, alone[1][5:7], atol=1e-3)


def test_no_tensor_of_n_by_n_is_allocated(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (24,), generator=g).tolist()
    trajs = [
        Trajectory(ids, [0] * 24 + [1] * 12, [0.0] * 36, [-1] * 24 + [0] * 12, [0.0])
        for ids in (prompt + torch.randint(0, 256, (12,), generator=g).tolist() for _ in range(24))
    ]
    batch = pack(trajs, extra={"advantages": [torch.ones(36)] * 24}, tree=True)
    n = batch.tree.num_tokens
    # The prompt once and the answers (a few share their first tokens); more tokens than the
    # vocabulary, so the [N, V] logits do not count as N x N.
    assert 260 < n <= 24 + 24 * 12 < batch.num_tokens
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=register_packed_attention()
    ).train()
    with _ShapeRecorder() as recorder:
        _, _, loss = _loss(model, batch)
        loss.backward()
    assert [s for s in recorder.shapes if sum(d >= n for d in s) >= 2] == []


def test_micro_batches_keep_shared_prefixes_together_and_count_tree_tokens():
    rng = random.Random(1)
    groups = []
    for g in range(6):  # six prompts of 40 tokens, eight answers of 5-20 tokens each
        prompt = [1000 + g] + [rng.randrange(500) for _ in range(39)]
        groups.append([prompt + [rng.randrange(500) for _ in range(rng.randrange(5, 21))]
                       for _ in range(8)])  # fmt: skip
    seqs = [s for group in groups for s in group]
    rng.shuffle(seqs)
    budget = 260
    for world in (1, 2):
        everyone = []
        for rank in range(world):
            mine, most = tree_rank_micro_batches(seqs, world, rank, budget)
            assert len(mine) <= most
            for members in mine:
                assert prefix_tree.tree_tokens([seqs[i] for i in members]) <= budget
            everyone += [i for members in mine for i in members]
        assert sorted(everyone) == list(range(len(seqs)))  # each sequence once
    # A group whose tree fits the budget is never split (one group's tree is at most 200).
    mine, _ = tree_rank_micro_batches(seqs, 1, 0, budget)
    where = {i: k for k, members in enumerate(mine) for i in members}
    for group in groups:
        assert len({where[seqs.index(s)] for s in group}) == 1


# --------------------------------------------------------------------------- the trainer


def _trainer_cfg(model_path, **overrides) -> RunConfig:
    return RunConfig.from_dict(
        {
            "base_model": str(model_path),
            "mode": "online",
            "batch_size": 12,
            "learning_rate": 1e-3,
            "micro_batch_tokens": 64,
            **overrides,
        }
    )


def _groups_batch(seed: int = 0) -> list[Trajectory]:
    """Three GRPO-like groups of four answers to a 20-token prompt, behaviour slightly off."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for group in range(3):
        prompt = torch.randint(0, 256, (20,), generator=g).tolist()
        for member in range(4):
            answer = torch.randint(0, 256, (3 + 2 * member,), generator=g).tolist()
            mask = [0] * 20 + [1] * len(answer)
            trajs.append(
                Trajectory(
                    prompt + answer,
                    mask,
                    [-1.5 * m for m in mask],
                    [0 if m else -1 for m in mask],
                    [float((group + member) % 3)],
                    f"g{group}",
                )
            )
    return trajs


def _pre_step_grads(trainer):
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.append(torch.cat([p.grad.detach().reshape(-1) for p in trainer.params]))
    )
    return seen


@pytest.mark.parametrize(
    "settings",
    [{}, {"lora_rank": 8}, {"gradient_checkpointing": True, "kl_coef": 0.1}],
    ids=["full", "lora", "checkpointing+kl"],
)
def test_a_trainer_step_with_trees_equals_the_flat_step(tiny_model_dir, settings):
    """The same batch through PPOTrainer with and without prefix trees: the same loss and
    gradients (read before the optimizer steps), far fewer tokens computed; with LoRA, and
    with gradient checkpointing and a reference model's KL term (its pass uses the tree too)."""
    results = {}
    for tree in (False, True):
        torch.manual_seed(0)  # the LoRA adapters' initialisation
        trainer = PPOTrainer(
            _trainer_cfg(tiny_model_dir, prefix_tree=tree, **settings), device="cpu"
        )
        grads = _pre_step_grads(trainer)
        stats = trainer.train_step(_groups_batch())
        results[tree] = (stats, grads)
    flat, tree = results[False], results[True]
    assert flat[0]["perf/computed_tokens_per_token"] == 1.0
    assert tree[0]["perf/computed_tokens_per_token"] < 0.6  # 3 x 20 + answers, not 12 x 20 + ...
    assert tree[0]["ppo/loss"] == pytest.approx(flat[0]["ppo/loss"], abs=1e-5, rel=1e-5)
    assert len(tree[1]) == len(flat[1]) == 1
    assert_close(tree[1][0], flat[1][0], atol=1e-5, rtol=1e-4)
    for name in ("rollout/reward", "ppo/n_trained_tokens", "rollout/num_trajectories"):
        if name in flat[0]:
            assert tree[0][name] == flat[0][name]


WORLD_SIZE = 2


def _worker(rank, model_path, store, out_dir, settings):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)  # the LoRA adapters' initialisation, as the one process's
        cfg = _trainer_cfg(model_path, prefix_tree=True, train_workers=WORLD_SIZE, **settings)
        trainer = PPOTrainer(cfg, device="cpu")
        assert trainer.fsdp
        grads = []  # the sharded (DTensor) gradients gathered whole
        trainer.optimizer.register_step_pre_hook(
            lambda *_: grads.append(
                torch.cat([p.grad.full_tensor().reshape(-1) for p in trainer.params])
            )
        )
        stats = trainer.train_step(_groups_batch())
        torch.save(grads, f"{out_dir}/grads_{rank}.pt")
        with open(f"{out_dir}/stats_{rank}.json", "w") as f:
            json.dump(stats, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{}, {"lora_rank": 8}], ids=["full", "lora"])
def test_two_fsdp_workers_with_trees_take_the_flat_one_process_step(
    tiny_model_dir, tmp_path, settings
):
    mp.spawn(
        _worker,
        args=(str(tiny_model_dir), str(tmp_path / "store"), str(tmp_path), settings),
        nprocs=WORLD_SIZE,
        join=True,
    )
    torch.manual_seed(0)
    trainer = PPOTrainer(_trainer_cfg(tiny_model_dir, prefix_tree=False, **settings), device="cpu")
    grads = _pre_step_grads(trainer)
    stats = trainer.train_step(_groups_batch())
    with open(tmp_path / "stats_0.json") as f:
        ranked = json.load(f)  # rank 0 reports the step's stats
    assert ranked["ppo/loss"] == pytest.approx(stats["ppo/loss"], abs=1e-5, rel=1e-5)
    assert ranked["perf/computed_tokens_per_token"] < 0.6
    assert stats["perf/computed_tokens_per_token"] == 1.0
    for rank in range(WORLD_SIZE):
        (got,) = torch.load(tmp_path / f"grads_{rank}.pt")
        assert_close(got, grads[0], atol=1e-5, rtol=1e-4)
