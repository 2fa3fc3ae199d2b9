"""Reward functions for dataset-mode runs, referenced by name or dotted path.

A reward function is any callable ``fn(prompt, completion, answer, metadata) -> float``:
``prompt`` is the rendered prompt text, ``completion`` the generated answer text,
``answer`` the dataset row's reference answer (may be None) and ``metadata`` the
row's remaining fields. Users write their own as plain functions and reference
them as ``"package.module:function"``; no registry.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import threading
from collections.abc import Callable
from typing import Any

RewardFn = Callable[[str, str, Any, dict], float]

_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def _normalise(text: Any) -> str:
    return " ".join(str(text).split())


def exact_match_reward_fn(
    prompt: str, completion: str, answer: Any, metadata: dict | None = None
) -> float:
    """1.0 when the completion equals the answer, ignoring surrounding and repeated whitespace."""
    if answer is None:
        raise ValueError("exact_match needs an 'answer' in every dataset row")
    return float(_normalise(completion) == _normalise(answer))


def regex_reward_fn(
    prompt: str,
    completion: str,
    answer: Any,
    metadata: dict | None = None,
    *,
    pattern: str,
    flags: str = "",
) -> float:
    """1.0 when ``pattern`` matches the completion.

    If the pattern has a named group ``answer``, the group of the *last* match must
    also equal the reference answer (whitespace-normalised): e.g.
    ``"####\\s*(?P<answer>-?\\d+)"`` for GSM8K-style final answers.
    """
    compiled = re.compile(pattern, _parse_flags(flags))
    matches = list(compiled.finditer(completion))
    if not matches:
        return 0.0
    if "answer" not in compiled.groupindex:
        return 1.0
    if answer is None:
        raise ValueError(
            "the regex has an (?P<answer>...) group but the dataset row has no 'answer'"
        )
    return float(_normalise(matches[-1].group("answer") or "") == _normalise(answer))


def _parse_flags(flags: str) -> int:
    value = 0
    for letter in flags:
        if letter not in _FLAGS:
            raise ValueError(f"unknown regex flag {letter!r}; use any of {''.join(_FLAGS)}")
        value |= _FLAGS[letter]
    return value


def math_reward_fn(
    prompt: str, completion: str, answer: Any, metadata: dict | None = None
) -> float:
    """1.0 when the completion's final answer is mathematically equivalent to ``answer`` (math-verify).

    The completion's answer is extracted as math-verify does (``\\boxed{}`` first,
    then the last LaTeX or plain expression), so "$\\boxed{1/2}$" matches "0.5".
    """
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("math needs an 'answer' in every dataset row")
    # math-verify's timeouts use signal.alarm, which only works on the main thread;
    # elsewhere (a Ray actor's worker thread) run without it.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(answer), parsing_timeout=timeout)
    predicted = parse(completion, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify could not parse the reference answer {answer!r}")
    return float(verify(gold, predicted, timeout_seconds=timeout))


_BUILTIN: dict[str, RewardFn] = {"exact_match": exact_match_reward_fn, "math": math_reward_fn}


def import_function(path: str) -> Callable:
    """Import ``"package.module:function"``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"a reward function path looks like 'package.module:function'; got {path!r}"
        )
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{path!r} does not name a function in module {module_name!r}")
    return fn


def load_reward_fn(spec: dict[str, Any] | str) -> RewardFn:
    """The reward function a run's ``reward`` setting names.

    ``spec`` is ``{"type": "exact_match" | "math"}``, ``{"type": "regex", "pattern": ..., "flags"?: "ims"}``,
    ``{"type": "python", "path": "module:function"}``, or a string: a type name or a dotted path.
    """
    if isinstance(spec, str):
        spec = {"type": "python", "path": spec} if ":" in spec else {"type": spec}
    kind = spec.get("type")
    if kind in _BUILTIN:
        return _BUILTIN[kind]
    if kind == "regex":
        re.compile(
            spec["pattern"], _parse_flags(spec.get("flags", ""))
        )  # fail at load, not per rollout
        return functools.partial(
            regex_reward_fn, pattern=spec["pattern"], flags=spec.get("flags", "")
        )
    if kind == "python":
        return import_function(spec["path"])
    if kind in ("judge", "human"):
        raise ValueError(
            f"a {kind} reward is given by the web app after an episode is submitted, not by a"
            " reward function; run it as a Steep run (its job submits episodes unscored)"
        )
    raise ValueError(f"unknown reward type {kind!r}; use exact_match, math, regex or python")


def score(
    fn: RewardFn, prompt: str, completion: str, answer: Any = None, metadata: dict | None = None
) -> tuple[float, str | None]:
    """Call a reward function safely: ``(reward, None)``, or ``(0.0, error)`` if it raised or
    returned something that is not a finite number. A user's buggy reward is recorded on the
    trajectory, not a crashed run."""
    try:
        value = fn(prompt, completion, answer, metadata or {})
        reward = float(value)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        return 0.0, f"{type(exc).__name__}: {exc}"
    if not math.isfinite(reward):
        return 0.0, f"reward function returned {value!r}, not a finite number"
    return reward, None
