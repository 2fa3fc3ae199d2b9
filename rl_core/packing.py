"""Packing trajectories into padding-free micro-batches, and next-token logprobs over them.

Sequences are concatenated into one row ``[1, T_total]``; ``position_ids`` restart
at 0 for each sequence and ``cu_seqlens`` holds the boundaries. Attention must not
cross sequences: a model loaded with a packed attention implementation
(``rl_core.attention``; the trainer's are) reads the boundaries and attends within
each sequence, in memory that never grows with ``T^2``. Any other model (sdpa/eager)
gets an explicit dense 4-D block-diagonal causal mask: correct, but ``T x T``; it is
kept as the benchmark's "before" baseline (``bench/train_step.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_core import prefix_tree
from rl_core.attention import (
    PACKED_ATTENTION,
    PACKED_IMPLEMENTATIONS,
    packed_attention_kwargs,
    tree_attention_kwargs,
)
from rl_core.head import chunked_scores, hidden_states_out, output_head
from rl_core.types import Trajectory


@dataclass
class PackedBatch:
    """Several trajectories as one padding-free row; per-token tensors are flat ``[T]``.

    Index ``t`` of every per-token tensor refers to token ``t`` of ``input_ids`` (the
    logprob *of* that token). The first token of each sequence has no prediction, so
    its ``loss_mask`` is 0.
    """

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    cu_seqlens: torch.Tensor  # [S + 1] int32, cumulative sequence lengths starting at 0
    seq_ids: torch.Tensor  # [T] long, sequence index 0..S-1 of each token
    loss_mask: torch.Tensor  # [T] bool
    logprobs: torch.Tensor  # [T] float, behaviour logprobs
    indices: list[int]  # positions of the packed trajectories in the list given to `pack`
    extra: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # more [T] tensors (advantages, ...)
    # [T] float: the temperature each token's behaviour logprob was taken at
    # (rl_core.sampling); None when every token's is 1.0, which skips the division.
    temperatures: torch.Tensor | None = None
    # The sequences' lengths as Python ints (``cu_seqlens`` on the host): attention reads its
    # boundaries from them without a device-to-host copy in every layer.
    lengths: list[int] | None = None
    # The sequences as a prefix tree (``pack(..., tree=True)`` where they share prefixes):
    # the model runs over its tokens, each shared prefix once (rl_core.prefix_tree).
    tree: prefix_tree.TreeLayout | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def computed_tokens(self) -> int:
        """The tokens the model runs over: the tree's where there is one."""
        return self.num_tokens if self.tree is None else self.tree.num_tokens

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            seq_ids=self.seq_ids.to(device),
            loss_mask=self.loss_mask.to(device),
            logprobs=self.logprobs.to(device),
            indices=self.indices,
            extra={k: v.to(device) for k, v in self.extra.items()},
            temperatures=None if self.temperatures is None else self.temperatures.to(device),
            lengths=self.lengths,
            tree=None if self.tree is None else self.tree.to(device),
        )


def pack(
    trajectories: Sequence[Trajectory],
    indices: Sequence[int] | None = None,
    extra: Mapping[str, Sequence[torch.Tensor]] | None = None,
    *,
    tree: bool = False,
) -> PackedBatch:
    """Pack ``trajectories[i]`` for ``i`` in ``indices`` (all by default) into one row.

    ``extra[name][i]`` is a per-token tensor ``[L_i]`` (or ``[L_i, k]``) of trajectory ``i``
    (indexed like ``trajectories``), concatenated into ``batch.extra[name]`` ``[T]`` (``[T, k]``).
    ``tree``: also lay the sequences out as a prefix tree when they share a prefix
    (``batch.tree``); the per-token tensors stay flat. Tokens whose ``extra["teacher_topk_ids"]``
    rows differ do not merge (their top-k logprobs are of other ids).
    """
    idx = list(range(len(trajectories))) if indices is None else list(indices)
    if not idx:
        raise ValueError("cannot pack an empty list of trajectories")
    trajs = [trajectories[i] for i in idx]
    lengths = torch.tensor([len(t.input_ids) for t in trajs])  # [S]
    cu = torch.zeros(len(trajs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    mask = torch.tensor([m for t in trajs for m in t.loss_mask], dtype=torch.bool)  # [T]
    mask[cu[:-1].long()] = False  # nothing predicts a sequence's first token
    temperatures = None
    if any(t.temperatures is not None and any(x != 1.0 for x in t.temperatures) for t in trajs):
        temperatures = torch.tensor(
            [x for t in trajs for x in (t.temperatures or [1.0] * len(t.input_ids))],
            dtype=torch.float32,
        )  # [T]
    extras = {
        name: torch.cat([_per_token_extra(vals[i]) for i in idx])
        for name, vals in (extra or {}).items()
    }
    layout = None
    if tree:
        seqs = [t.input_ids for t in trajs]
        layout = _tree(seqs, temperatures, lengths.tolist(), extras.get("teacher_topk_ids"))
    return PackedBatch(
        tree=layout,
        input_ids=torch.tensor([[x for t in trajs for x in t.input_ids]], dtype=torch.long),
        position_ids=torch.cat([torch.arange(n) for n in lengths.tolist()])[None],
        cu_seqlens=cu,
        seq_ids=torch.repeat_interleave(torch.arange(len(trajs)), lengths),
        loss_mask=mask,
        logprobs=torch.tensor([x for t in trajs for x in t.logprobs], dtype=torch.float32),
        indices=idx,
        extra=extras,
        temperatures=temperatures,
        lengths=lengths.tolist(),
    )


def _per_token_extra(values: Any) -> torch.Tensor:
    tensor = torch.as_tensor(values)
    return tensor if tensor.dim() > 1 else tensor.reshape(-1)  # [L] or [L, k]


def _tree(
    seqs: list[list[int]],
    temperatures: torch.Tensor | None,
    lengths: list[int],
    topk_ids: torch.Tensor | None = None,  # [T, k]
) -> prefix_tree.TreeLayout | None:
    """The sequences' prefix tree, or None where they share nothing. Tokens scored at
    different temperatures, or at other top-k ids, do not merge (their scores differ)."""
    keys = None
    if temperatures is not None or topk_ids is not None:
        columns = [] if temperatures is None else [temperatures[:, None].double()]
        columns += [] if topk_ids is None else [topk_ids.double()]
        _, codes = torch.unique(torch.cat(columns, 1), dim=0, return_inverse=True)  # [T]
        keys = [c.tolist() for c in codes.split(lengths)]
    layout = prefix_tree.build(seqs, keys)
    return layout if layout.num_tokens < sum(lengths) else None


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``max_tokens`` tokens.

    First-fit decreasing, so a handful of long sequences do not leave many half-empty
    micro-batches. A sequence longer than the budget gets a micro-batch of its own
    (it cannot be split without breaking attention). Deterministic for given input.
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask ``[1, 1, T, T]``: 0 where a token may attend (same sequence,
    not in the future), the dtype's minimum elsewhere. Additive floats work for both
    the eager path (adds the mask) and sdpa. O(T^2): only for models without packed
    attention (the benchmark's dense baseline)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
    seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=cu_seqlens.device), lengths
    )  # [T]
    n = seq.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=seq.device).tril()  # [T, T]
    allowed = causal & (seq[:, None] == seq[None, :])  # [T, T]
    mask = torch.zeros(n, n, dtype=dtype, device=seq.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]  # [1, 1, T, T]


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = 1024,
    from_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each token given its sequence's prefix, from a HF causal LM: ``(logprobs [T], entropy [T] | None)``.

    Entry ``t`` scores ``input_ids[t]`` under the logits at ``t - 1``; each sequence's
    first entry is 0. ``entropy[t]`` is the entropy of that predictive distribution
    (``entropy_grad=False`` detaches it: a logged stat then costs no activation memory).
    Gradients flow when called outside ``torch.no_grad``.

    The distribution is ``softmax(logits / T)`` with ``T`` the scored token's own
    temperature (``batch.temperatures``: the one its behaviour logprob was taken at, see
    ``rl_core.sampling``), or ``temperature`` for every token when given. The division
    is per chunk, like a single temperature's: per-token temperatures cost no extra
    ``[T, V]`` tensor, and a batch at temperature 1 skips it.

    ``from_hidden`` (the default): the model's forward stops at its last hidden states and
    the scores are taken ``chunk_tokens`` rows at a time against its output projection, each
    chunk's logits recomputed in the backward (``rl_core.head``): no ``[T, V]`` tensor is made
    or kept. False (or a model whose logits are not a plain projection): the model's own
    ``[T, V]`` logits, scored chunk by chunk (what the benchmarks call "today").
    """
    logprobs, entropy, _ = packed_scores(
        model,
        batch,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_tokens=chunk_tokens,
        from_hidden=from_hidden,
    )
    return logprobs, entropy


def packed_scores(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    topk_ids: torch.Tensor | None = None,  # [T, k]
    temperature: float | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = 1024,
    from_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``packed_logprobs``, and with ``topk_ids`` (``[T, k]``: ``k`` token ids per position,
    a teacher's top-k) the same distribution's logprobs at those ids: ``(logprobs [T],
    entropy [T] | None, topk [T, k] | None)``. Row ``t`` of ``topk`` is scored where token
    ``t`` is (the logits at ``t - 1``, its temperature), from the same chunk's logits: no
    ``[T, V]`` tensor beyond a chunk, gradients flowing as the logprobs' do; each sequence's
    first row is 0."""
    attention = getattr(model.config, "_attn_implementation", None)
    if batch.tree is not None and attention == PACKED_ATTENTION:
        return _tree_logprobs(
            model,
            batch,
            batch.tree,
            topk_ids=topk_ids,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            chunk_tokens=chunk_tokens,
            from_hidden=from_hidden,
        )
    ids, pos = batch.input_ids, batch.position_ids  # [1, T], [1, T]
    kwargs: dict = {"position_ids": pos, "use_cache": False}
    if attention in PACKED_IMPLEMENTATIONS:
        kwargs.update(packed_attention_kwargs(batch.cu_seqlens, batch.lengths))
    else:
        kwargs["attention_mask"] = block_causal_mask(
            batch.cu_seqlens, next(model.parameters()).dtype
        )
    targets = ids[0, 1:]  # [T-1]
    temps = None if temperature is not None or batch.temperatures is None else batch.temperatures
    scale = temps[1:, None] if temps is not None else temperature  # [T-1, 1] | float | None
    rows, head, recompute = _rows(model, ids, kwargs, from_hidden)  # [T, H | V]
    lps, ents, tops = _scored(
        head,
        rows[:-1],  # row t → token t+1
        targets,
        scale,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_tokens=chunk_tokens,
        recompute=recompute,
        topk_ids=None if topk_ids is None else topk_ids[1:],  # [T-1, k]
    )
    return _per_token(batch, lps, ents, tops, with_entropy)


def _scored(
    *args: Any, **kwargs: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``chunked_scores`` collected: each chunk's logprobs ``[C]``, and entropies and top-k
    logprobs ``[C, k]`` if asked."""
    lps, ents, tops = [], [], []
    for logprobs, entropy, topk in chunked_scores(*args, **kwargs):
        lps.append(logprobs)  # [C]
        if entropy is not None:
            ents.append(entropy)  # [C]
        if topk is not None:
            tops.append(topk)  # [C, k]
    return lps, ents, tops


def _rows(
    model: torch.nn.Module, ids: torch.Tensor, kwargs: dict, from_hidden: bool
) -> tuple[torch.Tensor, torch.nn.Module, bool]:
    """The forward's rows: ``[T, H]`` last hidden states to score against the output head
    (``chunked_scores`` recomputes each chunk's logits in the backward), or the model's own
    ``[T, V]`` logits; with the head that scores them and whether to recompute."""
    place = output_head(model) if from_hidden else None
    if place is not None:
        with hidden_states_out(model, place):
            rows = model(input_ids=ids, **kwargs).logits[0]  # [T, H]
        return rows, place[2], True
    # The model's own logits, scored chunk by chunk so that, without grad (proximal and
    # reference passes), no float32 copy of all T x V of them is alive at once; with
    # grad, autograd keeps each chunk anyway.
    return model(input_ids=ids, **kwargs).logits[0], torch.nn.Identity(), False  # [T, V]


def _tree_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    tree: prefix_tree.TreeLayout,
    *,
    topk_ids: torch.Tensor | None,  # [T, k]
    temperature: float | None,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_tokens: int,
    from_hidden: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``packed_logprobs`` over the batch's prefix tree: the forward runs over the tree's
    ``N`` tokens; each tree token is scored once, from the row of the token before it in
    its sequences, and every flat token takes its tree token's score (``[T]`` tensors as
    the flat path returns, 0 at each sequence's first token)."""
    kwargs: dict = {"position_ids": tree.position_ids, "use_cache": False}
    kwargs.update(tree_attention_kwargs(tree.lengths, tree.ancestors))
    rows, head, recompute = _rows(model, tree.input_ids, kwargs, from_hidden)  # [N, H | V]
    scored = torch.nonzero(tree.pred >= 0).reshape(-1)  # [P]: all but each root's first token
    scale: torch.Tensor | float | None = temperature
    if temperature is None and batch.temperatures is not None:
        temps = batch.temperatures.new_ones(tree.num_tokens)  # [N]
        temps[tree.flat_index] = batch.temperatures  # merged tokens share their temperature
        scale = temps[scored, None]  # [P, 1]
    tree_topk = None
    if topk_ids is not None:  # merged tokens share their ids (pack keys the tree by them)
        tree_topk = topk_ids.new_zeros(tree.num_tokens, topk_ids.shape[1])  # [N, k]
        tree_topk[tree.flat_index] = topk_ids
        tree_topk = tree_topk[scored]  # [P, k]
    lps, ents, tops = _scored(
        head,
        rows[tree.pred[scored]],  # [P, H | V]
        tree.input_ids[0, scored],  # [P]
        scale,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_tokens=chunk_tokens,
        recompute=recompute,
        topk_ids=tree_topk,
    )
    # Tree token -> its score's place; each root's first token (a sequence's first) -> 0.
    slot = torch.full((tree.num_tokens,), len(scored), device=scored.device)  # [N]
    slot[scored] = torch.arange(len(scored), device=scored.device)
    flat_slot = slot[tree.flat_index]  # [T]
    zero = batch.logprobs.new_zeros(1)
    logprobs = torch.cat([*lps, zero])[flat_slot]  # [T]
    entropy = torch.cat([*ents, zero])[flat_slot] if with_entropy else None  # [T]
    topk = None
    if topk_ids is not None:
        topk = torch.cat([*tops, zero.new_zeros(1, topk_ids.shape[1])])[flat_slot]  # [T, k]
    return logprobs, entropy, topk


def _per_token(
    batch: PackedBatch,
    lps: list[torch.Tensor],
    ents: list[torch.Tensor],
    tops: list[torch.Tensor],
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The chunks' scores as ``[T]`` (top-k: ``[T, k]``) tensors, 0 at each sequence's first
    token."""
    starts = batch.cu_seqlens[:-1].long().to(batch.logprobs.device)  # [S]
    zero = batch.logprobs.new_zeros(1)
    logprobs = torch.cat([zero, *lps]).index_fill(0, starts, 0.0)  # [T]
    entropy = torch.cat([zero, *ents]).index_fill(0, starts, 0.0) if with_entropy else None  # [T]
    topk = None
    if tops:
        first = zero.new_zeros(1, tops[0].shape[1])
        topk = torch.cat([first, *tops]).index_fill(0, starts, 0.0)  # [T, k]
    return logprobs, entropy, topk
