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

**The demo task** (``DEMO_SETTINGS``, ``demo_rows``; what ``./steep up``'s dataset run
trains) is harder: each prompt asks for "v" or "a" (``DEMO_LETTERS``), so the model must
read the letter from the prompt. ``say_the_asked_letter_reward_fn`` gives the same credit
for the asked letter and takes 0.1 × the share of the *other* demo letter: without that
penalty the policy collapses onto whichever letter it found first and stays at half the
reward (measured). The reward curve has two phases: from ~0 to ~0.35 as the model learns
to answer with one of the letters, then up to ~0.7 as it learns which. A learning rate of
3e-4 (ten times lower than the toy's) keeps sampling diverse long enough for the second
phase; at 1e-3 the policy often collapsed onto one letter before it could tell them apart.
On 2 CPU cores it takes four or five minutes (docs/benchmarks/demo.md).
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


# --------------------------------------------------------------------------- the demo task

DEMO_LETTERS = "va"  # the two letters the untrained model samples most often (with "O")
DEMO_WRONG_LETTER_PENALTY = 0.1

DEMO_REWARD: dict[str, Any] = {
    "type": "python",
    "path": "rl_core.toy:say_the_asked_letter_reward_fn",
}

# ./steep up's dataset run: rises over a few minutes on 2 CPU cores (the module docstring).
DEMO_SETTINGS: dict[str, Any] = {
    "reward": DEMO_REWARD,
    "batch_size": 64,
    "group_size": 8,
    "max_new_tokens": 8,
    "temperature": 1.0,
    "learning_rate": 3e-4,
    "max_staleness": 1,
    "max_steps": 300,
    "save_every": 40,
}

# ./steep up's online run: trained by whatever agents send (the built-in demo agent plays
# the toy task), batch by batch; it stays running (max_steps is out of reach). It trains a
# rank-8 adapter, so it can attach to the demo's shared pool (webapp.runs.demo); adapters
# want a larger learning rate than full fine-tuning: 2e-2 is the one measured on the toy
# task in tests/rl_core/test_learning.py (LORA_TOY).
ONLINE_DEMO_SETTINGS: dict[str, Any] = {
    "batch_size": 8,
    "max_staleness": 2,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "learning_rate": 2e-2,
    "max_steps": 1_000_000,
    "save_every": 100,
}


def demo_rows(n: int = 512, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows asking for one of ``DEMO_LETTERS`` (drawn with ``seed``), in a random phrasing."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        letter = rng.choice(DEMO_LETTERS)
        rows.append({"prompt": rng.choice(PHRASINGS).format(letter=letter), "answer": letter})
    return rows


def say_the_asked_letter_reward_fn(
    prompt: str, completion: str, answer: Any, metadata: dict | None = None
) -> float:
    """``say_letter_reward_fn`` minus 0.1 × the share of characters that are another demo letter."""
    reward = say_letter_reward_fn(prompt, completion, answer, metadata)
    text = completion.strip()
    if reward == 1.0 or not text:
        return reward
    wrong = sum(ch in DEMO_LETTERS and ch != answer for ch in text) / len(text)
    return reward - DEMO_WRONG_LETTER_PENALTY * wrong


# --------------------------------------------------------------------------- a two-role game

# The speaker/listener game of multi-agent runs (issue 38; bench/multi_agent.py and
# tests/e2e/test_multi_agent_runs.py): the speaker sees a target letter and says one word; the
# listener sees only that word and must name the letter. Both roles get the listener's score,
# so the speaker learns only through what the listener makes of its word.
GAME_LETTERS = DEMO_LETTERS


# The speaker's prompt, in one of these wordings (the first is the game's own). Mixed per
# episode, a speaker that says one letter whatever the target cannot score in all of them.
SPEAKER_PHRASINGS = (
    "Target: {target}. Say one word that tells it.",
    "Secret letter {target}. Say a word for it.",
    "Hint at {target} in one word.",
    "The letter is {target}. Tell the listener.",
)


def speaker_prompt(target: str, phrasing: str = SPEAKER_PHRASINGS[0]) -> str:
    return phrasing.format(target=target)


def listener_prompt(word: str) -> str:
    return f"The word is: {word.strip()[:16]}. Which letter?"


def listener_score(answer: str, target: str) -> float:
    """The demo task's credit for naming ``target`` (the other game letter costs a little)."""
    return say_the_asked_letter_reward_fn("", answer, target)


def shown_letter(word: str) -> str | None:
    """The game letter ``word`` holds most of (None for none or a tie): what a listener that
    reads the word faithfully names."""
    counts = sorted(((word.count(letter), letter) for letter in GAME_LETTERS), reverse=True)
    if counts[0][0] == 0 or (len(counts) > 1 and counts[1][0] == counts[0][0]):
        return None
    return counts[0][1]


def listener_named(answer: str, target: str) -> bool:
    """Success: the answer holds more of ``target`` than of any other game letter."""
    counts = {letter: answer.count(letter) for letter in GAME_LETTERS}
    return counts[target] > 0 and all(n < counts[target] for k, n in counts.items() if k != target)
