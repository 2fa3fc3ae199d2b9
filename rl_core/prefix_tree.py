"""Sequences that share prefixes, laid out once as a tree (issue 37, after AReaL-DTA).

A GRPO group is ``group_size`` answers to one prompt; a forked session is one trajectory
per branch, each carrying the conversation before the fork; online agents begin every
trajectory with the same system prompt. Packed flat (``rl_core.packing``), each shared
prefix runs through the model once per sequence. ``build`` merges the sequences of a
micro-batch into a radix tree (a trie whose unbranching runs are one node) by their exact
token ids and lays each node's tokens out once, in depth-first order, each at its
position in its own sequences.

Attention follows the tree (``rl_core.attention``): a node's tokens see their ancestors'
tokens and the earlier tokens of their own node, nothing else. A token's logprob is taken
from the hidden state of the token before it in its sequence (for a node's first token,
its parent's last token); every flat token maps to the tree token it is
(``TreeLayout.flat_index``), so the loss is computed on flat per-token tensors exactly as
without the tree: each trajectory's term with its own advantage, clipping and behaviour
weight, the shared tokens' gradients summed in the backward.

The build sorts the sequences: sorted order is the tree's depth-first order, and the
longest common prefix of each sequence with the one before it says where it leaves the
path laid out so far (the nodes deeper than that are finished; the node it leaves in the
middle is split there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TreeLayout:
    """A micro-batch's sequences as a tree of ``N`` tokens (``T`` flat tokens).

    Nodes are in layout order and cover ``[0, N)`` without gaps: node ``i`` holds tree
    tokens ``starts[i] : starts[i] + lengths[i]``; ``ancestors[i]`` lists its ancestor nodes
    from the root down (empty for a root: the sequences need not share a first token).
    """

    input_ids: torch.Tensor  # [1, N] long
    position_ids: torch.Tensor  # [1, N] long: each token's position in its sequences
    flat_index: torch.Tensor  # [T] long: the tree token each flat token is
    pred: torch.Tensor  # [N] long: the tree token before each one in its sequences (-1: none)
    starts: list[int]
    lengths: list[int]
    ancestors: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> TreeLayout:
        return TreeLayout(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            flat_index=self.flat_index.to(device),
            pred=self.pred.to(device),
            starts=self.starts,
            lengths=self.lengths,
            ancestors=self.ancestors,
        )


@dataclass
class _Node:
    layout: int  # tree index of the node's first token
    depth: int  # its position in its sequences
    length: int
    parent: int  # node index, -1 for a root


def build(seqs: Sequence[Sequence[int]], keys: Sequence[Sequence[int]] | None = None) -> TreeLayout:
    """The tree of ``seqs`` (token ids). ``keys[i][t]``, when given, must also agree for two
    tokens to merge (e.g. the temperature each was scored at: tokens merge only where their
    logprob is the same quantity)."""
    if not seqs:
        raise ValueError("cannot build a tree of no sequences")
    arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
    match = arrays
    if keys is not None:
        base = 1 + max((max(k, default=0) for k in keys), default=0)
        match = [_keyed(a, k, base) for a, k in zip(arrays, keys, strict=True)]
    order = sorted(range(len(seqs)), key=lambda i: match[i].tolist())

    nodes: list[_Node] = []
    path: list[int] = []  # nodes from a root down to the last sequence's end
    runs: list[list[tuple[int, int]]] = [[] for _ in seqs]  # each sequence's (start, count)
    tokens: list[np.ndarray] = []
    size = 0
    previous: np.ndarray | None = None
    for i in order:
        seq, key = arrays[i], match[i]
        shared = 0 if previous is None else _common_prefix(previous, key)
        # The path's nodes that begin at or after the divergence are finished.
        while path and nodes[path[-1]].depth >= shared:
            path.pop()
        if path:
            top = nodes[path[-1]]
            if top.depth + top.length > shared:  # it leaves this node in the middle: split
                cut = shared - top.depth
                rest = _Node(top.layout + cut, shared, top.length - cut, path[-1])
                for node in nodes:  # the old node's children now hang from its lower half
                    if node.parent == path[-1]:
                        node.parent = len(nodes)
                top.length = cut
                nodes.append(rest)
        if len(seq) > shared:
            nodes.append(_Node(size, shared, len(seq) - shared, path[-1] if path else -1))
            path.append(len(nodes) - 1)
            tokens.append(seq[shared:])
            size += len(seq) - shared
        runs[i] = _runs(nodes, path, len(seq))
        previous = key

    nodes_in_layout = sorted(range(len(nodes)), key=lambda n: nodes[n].layout)
    index_of = {n: k for k, n in enumerate(nodes_in_layout)}
    starts = [nodes[n].layout for n in nodes_in_layout]
    lengths = [nodes[n].length for n in nodes_in_layout]
    ancestors: list[list[int]] = []
    pred = torch.arange(-1, size - 1)  # [N]: within a node, the token before
    positions = torch.empty(size, dtype=torch.long)  # [N]
    for n in nodes_in_layout:
        node = nodes[n]
        chain, parent = [], node.parent
        while parent >= 0:
            chain.append(index_of[parent])
            parent = nodes[parent].parent
        ancestors.append(chain[::-1])
        end_of_parent = nodes[node.parent].layout + nodes[node.parent].length if chain else 0
        pred[node.layout] = end_of_parent - 1  # -1 for a root's first token
        positions[node.layout : node.layout + node.length] = torch.arange(
            node.depth, node.depth + node.length
        )
    flat = [torch.arange(s, s + c) for i in range(len(seqs)) for s, c in runs[i]]
    return TreeLayout(
        input_ids=torch.from_numpy(np.concatenate(tokens))[None],
        position_ids=positions[None],
        flat_index=torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long),
        pred=pred,
        starts=starts,
        lengths=lengths,
        ancestors=ancestors,
    )


def tree_tokens(seqs: Sequence[Sequence[int]]) -> int:
    """How many tokens ``build(seqs)`` lays out (without building it)."""
    arrays = sorted((np.asarray(s, dtype=np.int64) for s in seqs), key=lambda a: a.tolist())
    total, previous = 0, None
    for seq in arrays:
        total += len(seq) - (0 if previous is None else _common_prefix(previous, seq))
        previous = seq
    return total


def _keyed(ids: np.ndarray, key: Sequence[int], base: int) -> np.ndarray:
    """Token ids and a per-token key (``0 <= key < base``) as one comparable int64 per token."""
    return ids * base + np.asarray(key, dtype=np.int64)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _runs(nodes: list[_Node], path: list[int], length: int) -> list[tuple[int, int]]:
    """The tree tokens of a sequence of ``length`` tokens that ends on ``path``."""
    runs = []
    for n in path:
        node = nodes[n]
        count = min(node.length, length - node.depth)
        if count > 0:
            runs.append((node.layout, count))
    return runs


# Sequences that share fewer tokens than this are planned apart (a chunk boundary): two
# answers to one prompt share the prompt; unrelated ones may share a BOS token or a chat
# template's header, not worth keeping together in a micro-batch.
MIN_SHARED = 16


def _sorted_runs(seqs: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """``(index, shared with the one before, length)`` of each sequence, in sorted order."""
    arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: arrays[i].tolist())
    out, previous = [], None
    for i in order:
        shared = 0 if previous is None else _common_prefix(previous, arrays[i])
        out.append((i, shared, len(arrays[i])))
        previous = arrays[i]
    return out


def clusters(seqs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of ``seqs`` in runs that share at least ``MIN_SHARED`` tokens with the one
    before them (sorted order): e.g. each GRPO group, each forked session."""
    out: list[list[int]] = []
    for i, shared, _ in _sorted_runs(seqs):
        if out and shared >= MIN_SHARED:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def chunks(seqs: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """``seqs`` cut into chunks of sequences that share prefixes, each of at most
    ``max_tokens`` tree tokens (a longer sequence is a chunk of its own), and the tree tokens
    of each: the units a tree micro-batch plan packs (``distributed.tree_rank_micro_batches``)."""
    groups: list[list[int]] = []
    costs: list[int] = []
    for i, shared, length in _sorted_runs(seqs):
        added = length - shared
        if groups and shared >= MIN_SHARED and costs[-1] + added <= max_tokens:
            groups[-1].append(i)
            costs[-1] += added
        else:
            groups.append([i])
            costs.append(length)
    return groups, costs
