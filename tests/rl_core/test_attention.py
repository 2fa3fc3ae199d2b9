"""Padding-free packed attention: same numbers as one sequence at a time, and no T x T tensor."""

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rl_core.attention import PACKED_ATTENTION, packed_attention_forward, register_packed_attention
from rl_core.loss import LossConfig, ppo_loss
from rl_core.packing import pack, packed_logprobs
from rl_core.types import Trajectory


def _traj(ids, n_prompt, seed):
    g = torch.Generator().manual_seed(seed)
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    behaviour = (-torch.rand(len(ids), generator=g)).tolist()
    return Trajectory(
        input_ids=ids,
        loss_mask=mask,
        logprobs=[lp * m for lp, m in zip(behaviour, mask, strict=True)],
        versions=[0 if m else -1 for m in mask],
        rewards=[1.0],
    )


def _trajs(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        _traj(torch.randint(0, vocab, (n,), generator=g).tolist(), 2, seed + i)
        for i, n in enumerate(lengths)
    ]


def _qwen2(attention):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


@pytest.fixture(params=["llama", "qwen2"])
def models(request, tiny_model_dir):
    """(packed-attention model, eager reference with the same weights), both float32."""
    from transformers import AutoModelForCausalLM

    packed_name = register_packed_attention()
    if request.param == "llama":
        packed, ref = (
            AutoModelForCausalLM.from_pretrained(
                tiny_model_dir, dtype=torch.float32, attn_implementation=name
            )
            for name in (packed_name, "eager")
        )
    else:
        packed, ref = _qwen2(packed_name), _qwen2("eager")
        ref.load_state_dict(packed.state_dict())
    assert packed.config._attn_implementation == PACKED_ATTENTION
    return packed.train(), ref.train()


def _loss(model, batch, normalizer):
    logprobs, entropy = packed_logprobs(model, batch, with_entropy=True)
    loss, _ = ppo_loss(
        logprobs,
        batch.logprobs,
        batch.logprobs,
        torch.ones_like(batch.logprobs),  # [T] advantages
        batch.loss_mask,
        LossConfig(entropy_coef=0.01),
        entropy=entropy,
        seq_ids=batch.seq_ids,
        normalizer=normalizer,
    )
    return logprobs, loss


def _grads(model):
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_packed_loss_logprobs_and_gradients_equal_one_sequence_at_a_time(models):
    packed_model, ref_model = models
    vocab = packed_model.config.vocab_size
    trajs = _trajs([7, 4, 13, 3, 9], vocab)
    batch = pack(trajs)
    normalizer = float(batch.loss_mask.sum())
    logprobs, loss = _loss(packed_model, batch, normalizer)
    loss.backward()
    packed_grads = _grads(packed_model)

    single_loss = torch.zeros(())
    for i, traj in enumerate(trajs):
        lp, part = _loss(ref_model, pack([traj]), normalizer)
        part.backward()
        single_loss = single_loss + part.detach()
        start, end = batch.cu_seqlens[i].item(), batch.cu_seqlens[i + 1].item()
        assert_close(logprobs[start:end].detach(), lp.detach(), atol=1e-5, rtol=1e-5)
    assert_close(loss.detach(), single_loss, atol=1e-5, rtol=1e-5)
    for got, want in zip(packed_grads, _grads(ref_model), strict=True):
        assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_boundaries_fall_back_to_position_ids_restarting_at_zero():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g) for _ in range(3))  # [1, H, T, D]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    by_pos, _ = packed_attention_forward(torch.nn.Module(), q, k, v, None, position_ids=pos)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    by_cu, _ = packed_attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu)
    assert by_pos.shape == (1, 7, 2, 4)
    assert_close(by_pos, by_cu)
    # The second sequence's first token sees only itself: its output is its own value.
    assert_close(by_cu[0, 3], v[0, :, 3])


class _ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def _square_shapes(model, trajs):
    """Shapes with two dims >= T among all op outputs of a forward+backward on the packed batch."""
    batch = pack(trajs)
    n = batch.num_tokens
    with _ShapeRecorder() as recorder:
        _, loss = _loss(model, batch, float(batch.loss_mask.sum()))
        loss.backward()
    model.zero_grad(set_to_none=True)
    return [s for s in recorder.shapes if sum(d >= n for d in s) >= 2]


def test_no_tensor_of_t_by_t_is_allocated_for_many_short_sequences(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trajs = _trajs([8 + i % 9 for i in range(48)], vocab=256)
    n = sum(len(t.input_ids) for t in trajs)
    assert n > 260  # more tokens than the vocabulary, so [T, V] logits do not count as T x T
    packed = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=register_packed_attention()
    ).train()
    assert _square_shapes(packed, trajs) == []
    # The recorder does catch the dense path's T x T mask and scores.
    dense = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).train()
    assert (1, 1, n, n) in _square_shapes(dense, trajs)


def test_a_mask_or_sliding_window_is_refused_not_ignored():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="not a mask"):
        packed_attention_forward(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 3, 3))
    with pytest.raises(NotImplementedError, match="sliding window"):
        packed_attention_forward(torch.nn.Module(), q, q, q, None, sliding_window=2)
