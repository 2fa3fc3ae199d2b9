"""Self-distillation from feedback (issue 38): the policy, told what went wrong, is the teacher.

A session can carry a *hint*, a correction in words: the agent's ``hint`` with
``/rl/set_reward``, a person's feedback comment, or a judge's critique (``Session.hint``). In a
run with ``self_distill`` on, the teacher is the policy itself, served by the run's own
inference servers, reading the session's exact tokens with the hint inserted into its
context; its per-token judgement, ``log p(x_t | hint, x_<t) - log p(x_t | x_<t)``, becomes the
token's distillation signal (``rl_core.distill``). Tokens the hint makes likelier are pushed
up, tokens it makes unlikely are pushed down: a correction in words becomes a per-token
training signal (as in OpenPipe ART's self-distillation from hints, and context distillation).
Sessions without a hint train on their reward alone.

Where the hint goes (``hint_position``):

- ``system``: a system message before the conversation, rendered by the model's chat
  template (plain text when the template cannot render one), after a leading BOS token.
- ``before_response``: plain text right before the first answer token, as if the model had
  read the note just before it began answering.

``hint_template`` (``{hint}`` in it) words the note. The served policy is the latest version
pushed to the servers, so the teacher is at most the step's policy, never a future one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rl_core.types import Trajectory

HINT_POSITIONS = ("system", "before_response")


@dataclass
class HintPlacement:
    """Inserts a trajectory's hint into its tokens, and maps the teacher's scores back."""

    tokenizer: Any  # rl_core.chat.ChatTokenizer (the student's)
    position: str = "system"
    template: str = "A reviewer's note on this task: {hint}"

    def note_ids(self, hint: str) -> list[int]:
        note = self.template.replace("{hint}", hint)
        text = f"{note}\n\n"
        if self.position == "system":
            try:
                text = self.tokenizer.render(
                    [{"role": "system", "content": note}], add_generation_prompt=False
                )
            except Exception:  # a template without a system role: the note as plain text
                pass
        return list(self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)

    def insertion_point(self, traj: Trajectory) -> int:
        if self.position == "before_response":
            return traj.loss_mask.index(1)
        bos = self.tokenizer.special_tokens.get("bos_token")
        bos_id = self.tokenizer.tokenizer.token_to_id(bos) if bos else None
        return 1 if bos_id is not None and traj.input_ids[:1] == [bos_id] else 0

    def hinted(self, traj: Trajectory) -> tuple[list[int], int, int] | None:
        """``(input_ids with the note, where it starts, its length)``; None without a hint."""
        hint = str(traj.metadata.get("hint") or "").strip()
        if not hint:
            return None
        note = self.note_ids(hint)
        at = self.insertion_point(traj)
        return traj.input_ids[:at] + note + traj.input_ids[at:], at, len(note)


def unhinted(scores: Sequence[float], at: int, length: int) -> list[float]:
    """The teacher's scores of the original tokens (the note's own left out); the first
    token's is 0.0 as for any teacher."""
    out = list(scores[:at]) + list(scores[at + length :])
    if out:
        out[0] = 0.0
    return out


def signal_of(traj: Trajectory) -> dict[str, list]:
    """What a hint did to one trajectory, for the session page: each trained token and its
    signal ``teacher - student`` (rounded)."""
    assert traj.teacher_logprobs is not None
    tokens, signal = [], []
    for token, trained, teacher, student in zip(
        traj.input_ids, traj.loss_mask, traj.teacher_logprobs, traj.logprobs, strict=True
    ):
        if trained:
            tokens.append(token)
            signal.append(round(teacher - student, 4))
    return {"tokens": tokens, "signal": signal}
