"""The teacher's top-k at every position, for distillation's forward-KL term (``distill_topk``).

The sampled-token signal of ``rl_core.distill`` only judges what the student sampled: a token
the teacher favours but the student never samples gets no push. With ``distill_topk = k`` the
teacher also returns its ``k`` likeliest tokens at each position, with their logprobs, and the
loss gains ``distill_topk_coef * KL_t`` per trained token (``rl_core.loss.topk_forward_kl``),
computed from the student's logprobs of those ids (``rl_core.packing.packed_scores``).

How each teacher API returns them (row ``t`` is the distribution that predicts token ``t``;
row 0 has none):

- SGLang ``/generate`` (and Steep's torch engine): ``top_logprobs_num`` k beside
  ``return_logprob`` and ``logprob_start_len`` 0 → ``meta_info.input_top_logprobs``, one
  ``[[logprob, id, text], ...]`` per input token (``None`` for the first).
- vLLM ``/inference/v1/generate``: ``prompt_logprobs`` k → ``prompt_logprobs``, one
  ``{id: {logprob, rank, decoded_token}}`` per token (the top k, and the token itself).
- OpenAI-compatible ``/completions`` with ``echo`` and ``logprobs`` k: ``top_logprobs`` names
  tokens by their text, which cannot be mapped back to ids; vLLM's server names them
  ``token_id:<id>`` when asked (``return_tokens_as_token_ids``). Any other server's answer is
  refused with a ``TeacherError`` that says which APIs can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the job's loop process imports no torch
    import torch

    from rl_core.types import Trajectory

PAD_LOGPROB = float("-inf")  # a missing top-k entry: weight 0 in the loss
TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids


class TopKUnsupported(RuntimeError):
    """The teacher's server does not return top-k logprobs by token id."""


@dataclass
class TeacherTopK:
    """One trajectory's teacher scores: ``logprobs`` of the tokens themselves (as
    ``Teacher.logprobs``), and ``ids`` / ``topk_logprobs`` ``[T][k]`` (row 0: padding)."""

    logprobs: list[float]
    ids: list[list[int]]
    topk_logprobs: list[list[float]]

    def without(self, at: int, length: int) -> TeacherTopK:
        """These scores with positions ``[at, at + length)`` left out (a self-distillation
        hint's own tokens, ``rl_core.hints.unhinted``); row 0 is padding again."""
        logprobs = self.logprobs[:at] + self.logprobs[at + length :]
        ids = self.ids[:at] + self.ids[at + length :]
        values = self.topk_logprobs[:at] + self.topk_logprobs[at + length :]
        if ids:
            logprobs[0], ids[0] = 0.0, [0] * len(ids[0])
            values[0] = [PAD_LOGPROB] * len(values[0])
        return TeacherTopK(logprobs, ids, values)


def topk_rows(
    rows: Sequence[Sequence[tuple[float, int]] | None], length: int, k: int
) -> tuple[list[list[int]], list[list[float]]]:
    """``[T][k]`` ids and logprobs from one ``(logprob, id)`` list per position (best first
    or not; ``None`` or empty where the server gave none): the ``k`` likeliest of each row,
    padded with id 0 and ``PAD_LOGPROB`` when a row has fewer."""
    if len(rows) != length:
        raise ValueError(f"top-k rows for {len(rows)} of the {length} tokens sent")
    ids, values = [], []
    for t, row in enumerate(rows):
        best = [] if t == 0 or not row else sorted(row, key=lambda e: -e[0])[:k]
        ids.append([int(i) for _, i in best] + [0] * (k - len(best)))
        values.append([float(v) for v, _ in best] + [PAD_LOGPROB] * (k - len(best)))
    return ids, values


def sglang_rows(meta: dict[str, Any]) -> list[list[tuple[float, int]] | None]:
    """SGLang's ``meta_info.input_top_logprobs`` as ``(logprob, id)`` rows."""
    if "input_top_logprobs" not in meta:
        raise TopKUnsupported("its /generate answer has no input_top_logprobs")
    return [None if not row else [(e[0], e[1]) for e in row] for row in meta["input_top_logprobs"]]


def vllm_rows(
    prompt_logprobs: Sequence[dict | None], k: int
) -> list[list[tuple[float, int]] | None]:
    """vLLM's ``prompt_logprobs`` (``{id: {logprob, rank}}`` per token, which holds the token
    itself beside the top k) as the top-k ``(logprob, id)`` rows."""
    out: list[list[tuple[float, int]] | None] = []
    for row in prompt_logprobs:
        if not row:
            out.append(None)
            continue
        entries = []
        for key, entry in row.items():
            value = entry["logprob"] if isinstance(entry, dict) else entry
            rank = entry.get("rank") if isinstance(entry, dict) else None
            if rank is None or rank <= k:
                entries.append((float(value), int(key)))
        out.append(entries)
    return out


def openai_rows(top_logprobs: Sequence[dict | None]) -> list[list[tuple[float, int]] | None]:
    """An OpenAI ``/completions`` echo's ``top_logprobs`` (``{token: logprob}`` per token) as
    ``(logprob, id)`` rows; only a server that names tokens ``token_id:<id>`` can be read."""
    out: list[list[tuple[float, int]] | None] = []
    for row in top_logprobs:
        if not row:
            out.append(None)
            continue
        entries = []
        for token, value in row.items():
            if not token.startswith(TOKEN_ID_PREFIX):
                raise TopKUnsupported(
                    f"its /completions top_logprobs name tokens by text ({token!r}), not by id"
                )
            entries.append((float(value), int(token[len(TOKEN_ID_PREFIX) :])))
        out.append(entries)
    return out


def unsupported_message(name: str, why: str) -> str:
    return (
        f"the teacher {name} cannot give its top-k logprobs by token id: {why}. distill_topk "
        "needs teacher_api sglang (SGLang or Steep's torch engine) or vllm (or vLLM's own "
        "OpenAI server); set distill_topk to 0 to distil from the sampled tokens alone"
    )


# --------------------------------------------------------------------------- the trainer's side

TOPK_IDS, TOPK_LOGPROBS = "teacher_topk_ids", "teacher_topk_logprobs"  # PackedBatch.extra


def topk_extras(batch: Sequence[Trajectory]) -> dict[str, list[torch.Tensor]]:
    """The batch's teacher top-k as ``pack`` extras (``[L_i, k]`` per trajectory), or ``{}``
    when no trajectory has any. Untrained positions and unscored trajectories get padding (id
    0, ``PAD_LOGPROB``): they add nothing to the loss, and shared prompts still merge in a
    prefix tree."""
    import torch

    k = max((len(t.teacher_topk_ids[0]) for t in batch if t.teacher_topk_ids), default=0)
    if not k:
        return {}
    ids, values = [], []
    for traj in batch:
        n = len(traj.input_ids)
        row_ids = torch.zeros(n, k, dtype=torch.long)  # [L, k]
        row_values = torch.full((n, k), PAD_LOGPROB)  # [L, k]
        if traj.teacher_topk_ids is not None and traj.teacher_topk_logprobs is not None:
            trained = torch.tensor(traj.loss_mask, dtype=torch.bool)  # [L]
            got_ids = torch.tensor(traj.teacher_topk_ids, dtype=torch.long)  # [L, k']
            got_values = torch.tensor(traj.teacher_topk_logprobs, dtype=torch.float32)
            width = got_ids.shape[1]
            row_ids[trained, :width] = got_ids[trained]
            row_values[trained, :width] = got_values[trained]
        ids.append(row_ids)
        values.append(row_values)
    return {TOPK_IDS: ids, TOPK_LOGPROBS: values}
