"""Token log-probabilities from the last hidden states, without a ``[T, V]`` tensor kept.

A causal LM's forward ends in the output projection: ``logits = hidden @ W^T``, ``[T, V]``.
At 16k tokens and a 152k vocabulary that is 2.5 G entries (10 GB in float32), and when the
logprobs carry gradients autograd keeps every float32 chunk of it for the backward. Here the
model's forward stops at the hidden states ``[T, H]`` (its output projection swapped for the
identity for that one call), and the logprobs (and entropy) are scored ``chunk`` rows at a
time against the projection; each chunk runs under activation checkpointing, so the backward
recomputes its logits instead of keeping them. Memory for the scores is O(chunk x V) at any
moment, whatever T; the values and the gradients are those of the plain computation (the same
rows through the same projection). This is the "fused linear + log-softmax / cross-entropy"
of Liger-Kernel and of verl's and AReaL's chunked logprobs, written with torch's checkpoint
rather than a hand-written backward, so that it runs under autocast, LoRA and FSDP2 alike.

Under FSDP2 the projection is called after the root module's forward: the root's parameters
(embeddings, final norm, output projection) stay gathered until its backward (FSDP2 does not
reshard the root after forward), so the chunks use the gathered weight and their gradients
reach FSDP2's reduce-scatter with the rest of the root's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint


def output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.Module] | None:
    """``(parent, attribute, projection)`` of a causal LM whose logits are its output
    projection of the last hidden states and nothing more; None for one that scales or caps
    them after the projection (Gemma 2's soft-capping, Cohere's logit scale), which keeps
    the plain path."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Module):
        return None
    for module in model.modules():
        for attribute, child in module.named_children():
            if child is head:
                return module, attribute, head
    return None


@contextmanager
def hidden_states_out(model: torch.nn.Module, place: tuple[torch.nn.Module, str, torch.nn.Module]):
    """The model's forward returns its last hidden states as ``logits`` while inside."""
    parent, attribute, head = place
    setattr(parent, attribute, torch.nn.Identity())
    try:
        with warnings.catch_warnings():
            # FSDP2 warns that the root returned a view (the hidden states, sliced): an
            # in-place op on it would skip the backward's all-gather. The scores only read it.
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            yield
    finally:
        setattr(parent, attribute, head)


def _chunk_scores(
    head: torch.nn.Module,
    hidden: torch.Tensor,  # [C, H]
    targets: torch.Tensor,  # [C]
    scale: torch.Tensor | float | None,  # [C, 1], a float, or None
    with_entropy: bool,
    topk_ids: torch.Tensor | None = None,  # [C, k]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()  # [C, V]
    if scale is not None:
        logits = logits / scale
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    logprobs = logits.gather(-1, targets[:, None])[:, 0] - lse  # [C]
    # The same distribution at other ids (a teacher's top-k: rl_core.loss.topk_forward_kl).
    topk = logprobs.new_zeros(0) if topk_ids is None else logits.gather(-1, topk_ids) - lse[:, None]
    if not with_entropy:
        return logprobs, logprobs.new_zeros(0), topk
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [C]
    return logprobs, entropy, topk


def chunked_scores(
    head: torch.nn.Module,
    hidden: torch.Tensor,  # [N, H]
    targets: torch.Tensor,  # [N]
    scale: torch.Tensor | float | None,  # [N, 1], a float, or None (1)
    *,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_tokens: int,
    recompute: bool = True,
    topk_ids: torch.Tensor | None = None,  # [N, k]
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """``(logprobs [C], entropy [C] | None, topk [C, k] | None)`` of each ``chunk_tokens`` rows
    of ``hidden``: ``log_softmax(head(hidden) / scale)`` at ``targets`` (and at ``topk_ids``,
    the same distribution at k more ids per row, from the same chunk's logits). With gradients
    and ``recompute``, each chunk's logits are recomputed in the backward (activation
    checkpointing) rather than kept; ``recompute=False`` (rows that are logits already,
    ``head`` the identity) keeps them."""
    grad = recompute and torch.is_grad_enabled() and (hidden.requires_grad or _has_grad(head))
    if not isinstance(scale, torch.Tensor) and scale == 1.0:
        scale = None
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        chunk_scale = scale[rows] if isinstance(scale, torch.Tensor) else scale
        chunk_ids = None if topk_ids is None else topk_ids[rows]
        args = (head, hidden[rows], targets[rows], chunk_scale, with_entropy, chunk_ids)
        if grad:
            logprobs, entropy, topk = checkpoint(_chunk_scores, *args, use_reentrant=False)
        else:
            logprobs, entropy, topk = _chunk_scores(*args)
        if not with_entropy:
            entropy = None
        elif not entropy_grad:
            entropy = entropy.detach()
        yield logprobs, entropy, None if topk_ids is None else topk


def _has_grad(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())
