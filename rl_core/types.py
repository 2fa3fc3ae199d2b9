"""The trajectory: what one episode (a session, or one dataset answer) hands to the trainer.

Plain Python, no torch: the web app builds trajectories from recorded turns and
sends them to the Ray job as JSON (``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROMPT_VERSION = -1  # `versions` entry of a token the policy did not generate


@dataclass
class Trajectory:
    """One whole sequence (every turn), with per-token behaviour data.

    All per-token lists have ``len(input_ids)`` entries. ``rewards`` has one entry
    per assistant turn; a turn is a maximal run of ``loss_mask == 1`` tokens unless
    ``turn_ends`` says otherwise (two assistant turns with nothing in between).
    A single-turn episode has ``rewards == [r]``. Tokens between turns (tool results,
    user messages) belong to the turn after them but are never trained.
    """

    input_ids: list[int]
    loss_mask: list[int]  # 1 for generated (assistant) tokens, the only ones trained
    logprobs: list[float]  # behaviour logprobs from inference; 0.0 for prompt tokens
    versions: list[int]  # policy version that generated each token; -1 for prompt tokens
    rewards: list[float]  # one per assistant turn
    group_id: str = ""  # trajectories sharing a prompt (a GRPO group); "" = a group of one
    session_id: str = ""
    turn_ends: list[int] | None = None  # exclusive end index of each assistant turn
    metadata: dict[str, Any] = field(default_factory=dict)
    # The temperature each token's behaviour logprob was taken at (rl_core.sampling); the
    # trainer recomputes at the same one. None: 1.0 everywhere. Prompt tokens: 1.0 (untrained).
    temperatures: list[float] | None = None
    # A teacher's logprob of each token in its context (on-policy distillation, rl_core.distill):
    # set by the loop before the step when the run has a teacher; 0.0 for the first token.
    teacher_logprobs: list[float] | None = None
    # The teacher's top-k at each position (``distill_topk``, rl_core.distill_topk): ``[T][k]``
    # token ids and their logprobs, for the forward-KL term; set beside teacher_logprobs, kept
    # in memory only (not in to_dict: the job's trainer receives trajectories as objects).
    teacher_topk_ids: list[list[int]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None
    # A multi-agent run's role whose adapter produced the trained tokens (RunConfig.roles);
    # "" in a one-policy run.
    role: str = ""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        per_token = ("loss_mask", "logprobs", "versions")
        optional = tuple(
            k
            for k in (
                "temperatures",
                "teacher_logprobs",
                "teacher_topk_ids",
                "teacher_topk_logprobs",
            )
            if getattr(self, k) is not None
        )
        for name in per_token + optional:
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has {len(getattr(self, name))} entries but input_ids has {n}; "
                    "every per-token list must have one entry per token."
                )
        if self.temperatures is not None and not all(t > 0 for t in self.temperatures):
            raise ValueError("Trajectory.temperatures must all be > 0 (1.0 for greedy tokens).")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("Trajectory.loss_mask must contain only 0 and 1.")
        if not any(self.loss_mask):
            raise ValueError(
                "Trajectory has no generated tokens (loss_mask is all 0); nothing to train."
            )
        if self.loss_mask[0]:
            raise ValueError(
                "The first token cannot be generated: it has no context to be predicted from."
            )
        if any(v < 0 for v, m in zip(self.versions, self.loss_mask, strict=True) if m):
            raise ValueError("Every generated token needs its policy version (>= 0) in versions.")
        if not self.rewards:
            raise ValueError("Trajectory.rewards is empty; give at least one reward (per turn).")
        spans = self.turn_spans()
        if len(spans) != len(self.rewards):
            raise ValueError(
                f"Trajectory has {len(spans)} assistant turns but {len(self.rewards)} rewards; "
                "give one reward per turn (0.0 for unrewarded turns)."
            )

    def turn_spans(self) -> list[tuple[int, int]]:
        """``[start, end)`` token ranges of the turns, in order; each ends with its assistant tokens."""
        n = len(self.input_ids)
        if self.turn_ends is not None:
            ends = list(self.turn_ends)
            last_generated = max(i for i, m in enumerate(self.loss_mask) if m)
            increasing = all(a < b for a, b in zip([0, *ends], ends, strict=False))
            if not ends or not increasing or ends[-1] > n or ends[-1] <= last_generated:
                raise ValueError(
                    f"turn_ends must be increasing token indices, the last covering the last "
                    f"generated token and within the sequence; got {self.turn_ends}."
                )
        elif len(self.rewards) == 1:
            ends = [n]
        else:  # a turn ends where a run of generated tokens ends
            mask = self.loss_mask
            ends = [i + 1 for i in range(n) if mask[i] and (i + 1 == n or not mask[i + 1])]
        return list(zip([0, *ends[:-1]], ends, strict=True))

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among generated tokens: what staleness is measured from."""
        return min(v for v, m in zip(self.versions, self.loss_mask, strict=True) if m)

    def returns(self, discount: float = 1.0) -> list[float]:
        """Per-turn returns ``G_k = sum_{j >= k} discount^(j-k) * r_j``: later rewards credited to earlier turns."""
        out, g = [], 0.0
        for r in reversed(self.rewards):
            g = r + discount * g
            out.append(g)
        return out[::-1]

    def reward(self, discount: float = 1.0) -> float:
        """The episode's scalar reward: the return from its first turn (the plain sum when discount = 1)."""
        return self.returns(discount)[0]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (lists, numbers, strings) that ``from_dict`` turns back into an equal trajectory."""
        return {
            "input_ids": list(self.input_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": [float(x) for x in self.logprobs],
            "versions": list(self.versions),
            "rewards": [float(x) for x in self.rewards],
            "group_id": self.group_id,
            "session_id": self.session_id,
            "turn_ends": None if self.turn_ends is None else list(self.turn_ends),
            "metadata": dict(self.metadata),
            "temperatures": None
            if self.temperatures is None
            else [float(x) for x in self.temperatures],
            "role": self.role,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """Build from ``to_dict`` output; a bare ``reward`` number is accepted for single-turn episodes."""
        data = dict(data)
        if "rewards" not in data and "reward" in data:
            data["rewards"] = [data.pop("reward")]
        known = {
            "input_ids",
            "loss_mask",
            "logprobs",
            "versions",
            "rewards",
            "group_id",
            "session_id",
            "turn_ends",
            "metadata",
            "temperatures",
            "role",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown trajectory fields: {', '.join(unknown)}.")
        data["rewards"] = [float(r) for r in data["rewards"]]
        data["logprobs"] = [float(x) for x in data["logprobs"]]
        if data.get("temperatures") is not None:
            data["temperatures"] = [float(x) for x in data["temperatures"]]
        return cls(**data)
