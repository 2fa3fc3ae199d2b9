"""A toy task the tiny model (``rl_core.tiny``) visibly learns on 2 CPU cores in well under a minute.

The task: asked for the letter "v" in one of a few phrasings ("Say v.",
"Reply with the letter v.", "v?", ...), answer "v". The reward
(``say_letter_reward_fn``) is

* 1.0 when the stripped completion is exactly the letter;
* otherwise ``0.75 * (share of the completion's characters that are the letter)``.

Why this task, honestly: the randomly initialised tiny model emits mostly high
bytes, almost never a given letter and practically never its end-of-turn
token. An exact-match reward would be 0 for every sample, and GRPO would train
nothing. "v" is the lowercase letter the untrained model samples most often for
these prompts (measured over 384 sampled 8-token answers: 5.5% of answers contain
a "v", 0.7% of tokens; "b", the letter used before, is in 1.0% of answers, which
left the first hit to luck: one CI run found it only after ~45 steps). The
per-character share turns each hit into a gradient. With TOY_SETTINGS (8 new
tokens, groups of 8, learning rate 3e-3) and seeded sampling (``RunConfig.seed``)
the mean reward goes from ~0.01 to 0.75 ("vvvvvvvv") in about 10 steps, ~5 s with
one torch-engine server and the trainer sharing 2 CPU cores. 1.0 needs the model
to stop after one "v": it almost never samples its end-of-turn token, so a short
run does not learn that. We tried the natural variant, "Say x." for every letter x
with partial credit for lowercase letters: the tiny model cannot yet read the
letter from the prompt, collapses onto one letter for every prompt within ~10
steps and plateaus at the partial credit. A single target learns reliably.

Reward values are multiples of 3/32 for 8-character answers: exactly
representable, so a group whose answers all score the same gets exactly zero
advantage. This module imports nothing heavy: the web demo reads its rows and
settings.
"""

from __future__ import annotations

import random
from typing import Any

TOY_LETTER = "v"
PHRASINGS = (
    "Say {letter}.",
    "Please say {letter}.",
    "Reply with the letter {letter}.",
    "Write {letter}.",
    "{letter}?",
    "Answer with {letter} and nothing else.",
)

TOY_REWARD: dict[str, Any] = {"type": "python", "path": "rl_core.toy:say_letter_reward_fn"}

# Defaults for "reward visibly rises within a few minutes" with one torch-engine server
# and the trainer sharing 2 CPU cores (tests/rl_core/test_learning.py runs them).
TOY_SETTINGS: dict[str, Any] = {
    "reward": TOY_REWARD,
    "batch_size": 32,
    "group_size": 8,
    "max_new_tokens": 8,
    "temperature": 1.0,
    "learning_rate": 3e-3,
    "max_staleness": 1,
    "max_steps": 40,
    "save_every": 20,
}


def toy_rows(n: int = 64, seed: int = 0, letter: str = TOY_LETTER) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt": <a way of asking for letter>, "answer": letter}``; phrasings drawn with ``seed``."""
    rng = random.Random(seed)
    return [
        {"prompt": rng.choice(PHRASINGS).format(letter=letter), "answer": letter} for _ in range(n)
    ]


def say_letter_reward_fn(
    prompt: str, completion: str, answer: Any, metadata: dict | None = None
) -> float:
    """1.0 for exactly ``answer`` (one character); else 0.75 × the share of characters equal to it."""
    if not isinstance(answer, str) or len(answer) != 1:
        raise ValueError(f"the toy task's answer is one character; got {answer!r}")
    text = completion.strip()
    if text == answer:
        return 1.0
    if not text:
        return 0.0
    return 0.75 * sum(ch == answer for ch in text) / len(text)
