"""Logprobs from hidden states in token chunks (rl_core/head.py): the values and gradients of the
plain ``[T, V]`` computation, without that tensor ever being made, alone, with LoRA, with tied
embeddings and under FSDP2 on two gloo processes."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from rl_core.attention import register_packed_attention
from rl_core.hf import load_causal_lm
from rl_core.packing import pack, packed_logprobs
from rl_core.types import Trajectory

VOCAB = 260  # the tiny model's
# float32, the same rows through the same projection, summed in another order: the largest
# difference seen here was 8e-7 of the tensor's largest entry (logprobs, entropy, each gradient).
RELATIVE = 5e-6


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal within ``RELATIVE`` of ``expected``'s largest entry."""
    scale = max(expected.abs().max().item(), 1e-12)
    assert_close(actual, expected, atol=RELATIVE * scale, rtol=0, msg=lambda m: f"{what}: {m}")


def trajectories(lengths=(9, 4, 13, 6), seed=0, temperatures=False) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        mask = [0, 0] + [1] * (n - 2)
        traj = Trajectory(ids, mask, [0.0] * n, [0 if m else -1 for m in mask], [1.0])
        if temperatures:  # a turn at one temperature, the next at another
            traj.temperatures = (
                [1.0, 1.0] + [0.5 + 0.3 * i] * (n // 2 - 1) + [1.3] * (n - n // 2 - 1)
            )
        out.append(traj)
    return out


def model_of(tiny_model_dir, *, lora=False, tied=False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = load_causal_lm(
        tiny_model_dir, torch.float32, torch.device("cpu"), register_packed_attention()
    )
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.get_input_embeddings().weight
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # B = 0 would leave the adapter's gradients trivially equal
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.1)
    return model


def scores_and_grads(model, batch, *, from_hidden, **kwargs):
    """(logprobs, entropy, {name: grad}) of a loss that uses both, as the PPO loss does."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = packed_logprobs(
        model, batch, with_entropy=True, from_hidden=from_hidden, **kwargs
    )
    weights = torch.linspace(-1.0, 1.0, logprobs.shape[0])  # [T]: advantages of both signs
    ((logprobs * weights)[batch.loss_mask].sum() + 0.1 * entropy[batch.loss_mask].sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("variant", ["full", "lora", "tied"])
@pytest.mark.parametrize("temperature", [None, 0.7, "per-token"])
def test_chunked_logprobs_and_gradients_equal_the_plain_ones(tiny_model_dir, variant, temperature):
    model = model_of(tiny_model_dir, lora=variant == "lora", tied=variant == "tied")
    batch = pack(trajectories(temperatures=temperature == "per-token"))
    fixed = temperature if isinstance(temperature, float) else None
    plain = scores_and_grads(model, batch, from_hidden=False, temperature=fixed)
    # Chunks of 5 rows: boundaries fall inside sequences and across them.
    chunked = scores_and_grads(model, batch, from_hidden=True, temperature=fixed, chunk_tokens=5)
    assert_same(chunked[0], plain[0], "logprobs")
    assert_same(chunked[1], plain[1], "entropy")
    assert chunked[2].keys() == plain[2].keys() and plain[2]
    for name, grad in plain[2].items():
        assert_same(chunked[2][name], grad, name)
    assert any(grad.abs().sum() > 0 for grad in chunked[2].values())
    # The model's head is back in place after the call.
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)


def test_without_gradients_the_chunked_scores_equal_the_plain_ones(tiny_model_dir):
    model = model_of(tiny_model_dir).eval()
    batch = pack(trajectories(seed=3))
    with torch.no_grad():
        plain, _ = packed_logprobs(model, batch, from_hidden=False)
        chunked, _ = packed_logprobs(model, batch, chunk_tokens=3)
    assert_same(chunked, plain, "logprobs")


class LargestVocabularyTensor(TorchDispatchMode):
    """The most elements of any tensor with a vocabulary-sized dimension that an op produced
    while active (forward and backward): logits, their gradients, the projection's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and VOCAB in tensor.shape:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("from_hidden", [True, False])
def test_no_tensor_of_all_tokens_by_the_vocabulary_is_made_with_chunks(tiny_model_dir, from_hidden):
    model = model_of(tiny_model_dir)
    batch = pack(trajectories(lengths=(60, 50, 70)))  # T = 180 tokens, V = 260
    chunk, hidden = 8, model.config.hidden_size  # 8 rows of logits, the projection is [V, 32]
    with LargestVocabularyTensor() as seen:
        scores_and_grads(model, batch, from_hidden=from_hidden, chunk_tokens=chunk)
    tokens = batch.num_tokens
    if from_hidden:
        # Nothing bigger than one chunk's logits or the projection's weight was ever made.
        assert seen.largest <= VOCAB * max(chunk, hidden) < (tokens - 1) * VOCAB
    else:
        assert seen.largest >= (tokens - 1) * VOCAB  # the whole [T, V] logits


WORLD = 2


def _fsdp_worker(rank, model_dir, store, out):
    from rl_core.distributed import shard_model

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        model = model_of(model_dir)
        shard_model(model)
        # Each rank scores its half of the sequences; FSDP2 sums the gradients over ranks.
        mine = [t for i, t in enumerate(trajectories(temperatures=True)) if i % WORLD == rank]
        _, _, grads = scores_and_grads(model, pack(mine), from_hidden=True, chunk_tokens=5)
        full = {name: grad.full_tensor() for name, grad in grads.items()}
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_chunked_gradients_under_fsdp2_on_two_processes_equal_one_processs_plain_ones(
    tiny_model_dir, tmp_path
):
    out = tmp_path / "grads.pt"
    mp.start_processes(
        _fsdp_worker,
        args=(str(tiny_model_dir), str(tmp_path / "store"), str(out)),
        nprocs=WORLD,
        start_method="spawn",
    )
    sharded = torch.load(out)
    model = model_of(tiny_model_dir)
    plain = {}
    for rank in range(WORLD):  # the same sums, one process, the plain [T, V] path
        mine = [t for i, t in enumerate(trajectories(temperatures=True)) if i % WORLD == rank]
        for name, grad in scores_and_grads(model, pack(mine), from_hidden=False)[2].items():
            plain[name] = plain.get(name, 0) + grad
    assert sharded.keys() == plain.keys()
    for name, grad in plain.items():
        assert_same(sharded[name], grad, name)
