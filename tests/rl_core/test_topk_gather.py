"""The student's logprobs at a teacher's top-k ids (rl_core.packing.packed_scores): the full
softmax's values at those ids, at each token's temperature, flat and as a prefix tree, from
chunked scores that keep no [T, V] tensor; gradients flow."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rl_core.attention import register_packed_attention
from rl_core.distill_topk import TOPK_IDS, topk_extras
from rl_core.hf import load_causal_lm
from rl_core.packing import pack, packed_scores
from rl_core.types import Trajectory

PROMPT = list(range(3, 23))  # 20 shared prompt tokens
ANSWERS = ([40, 41, 42, 43], [40, 41, 50], [60, 61, 62])
K = 5


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    attention = register_packed_attention()
    return load_causal_lm(tiny_model_dir, torch.float32, torch.device("cpu"), attention).eval()


def _trajectories(shared_rows: bool) -> list[Trajectory]:
    """Three answers to one prompt at temperature 0.7, each with teacher top-k ids. With
    ``shared_rows`` the rows depend on the position only (the first two answers' common
    tokens merge in the tree); otherwise each answer's rows differ (they must not merge)."""
    out = []
    for a, answer in enumerate(ANSWERS):
        ids = PROMPT + answer
        n = len(ids)
        mask = [0] * len(PROMPT) + [1] * len(answer)
        gen = torch.Generator().manual_seed(0 if shared_rows else a)
        rows = torch.randint(0, 256, (n, K), generator=gen).tolist()
        traj = Trajectory(
            ids, mask, [-1.0 * m for m in mask], [0 if m else -1 for m in mask], [1.0],
            temperatures=[0.7 if m else 1.0 for m in mask],
        )  # fmt: skip
        traj.teacher_topk_ids = rows
        traj.teacher_topk_logprobs = [[-1.0] * K for _ in range(n)]
        out.append(traj)
    return out


def _reference(model, traj: Trajectory, ids_rows: torch.Tensor) -> torch.Tensor:
    """The full softmax at each row's ids, for the trained rows: ``[n_trained, K]``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([traj.input_ids])).logits[0].float()  # [L, V]
    temps = torch.tensor(traj.temperatures)[1:, None]  # [L-1, 1]
    logprobs = torch.log_softmax(logits[:-1] / temps, dim=-1)  # row t-1 predicts token t
    trained = torch.tensor(traj.loss_mask[1:], dtype=torch.bool)
    return logprobs.gather(-1, ids_rows[1:])[trained]


@pytest.mark.parametrize("tree", [False, True], ids=["flat", "tree"])
@pytest.mark.parametrize("shared_rows", [True, False], ids=["same-rows", "own-rows"])
def test_top_k_logprobs_equal_the_full_softmax_at_those_ids(model, tree, shared_rows):
    trajs = _trajectories(shared_rows)
    batch = pack(trajs, extra=topk_extras(trajs), tree=tree)
    if tree:
        assert batch.tree is not None
        shared = len(PROMPT) + (2 if shared_rows else 0)  # the prompt, and 40, 41 if rows agree
        assert batch.tree.num_tokens == batch.num_tokens - 2 * len(PROMPT) - (shared - len(PROMPT))
    with torch.no_grad():
        _, _, topk = packed_scores(model, batch, topk_ids=batch.extra[TOPK_IDS], chunk_tokens=7)
    assert topk is not None and topk.shape == (batch.num_tokens, K)
    starts = batch.cu_seqlens[:-1].tolist()
    for s, traj in enumerate(trajs):
        rows = batch.extra[TOPK_IDS][starts[s] : starts[s] + len(traj.input_ids)]  # [L, K]
        got = topk[starts[s] : starts[s] + len(traj.input_ids)][1:]
        got = got[torch.tensor(traj.loss_mask[1:], dtype=torch.bool)]
        assert_close(got, _reference(model, traj, rows), atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_the_chunks_alike_flat_and_as_a_tree(model):
    trajs = _trajectories(shared_rows=True)
    grads = []
    for tree in (False, True):
        model.zero_grad()
        batch = pack(trajs, extra=topk_extras(trajs), tree=tree)
        _, _, topk = packed_scores(model, batch, topk_ids=batch.extra[TOPK_IDS], chunk_tokens=7)
        assert topk is not None
        (topk * batch.loss_mask[:, None]).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert grads[0] and any(g.abs().sum() > 0 for g in grads[0])
    for flat, tree in zip(*grads, strict=True):
        assert_close(tree, flat, atol=1e-5, rtol=1e-4)
