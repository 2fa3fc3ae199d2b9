"""What a run's ``reward`` setting may say: each reward type, its keys, and their checks.

``rl_core.config.RunConfig`` validates ``reward`` with ``reward_spec_errors``; the reference
of every type (``REWARD_TYPES_DOC``) ends docs/run-settings.md. No Django, no torch.
"""

from __future__ import annotations

import math
import re
from typing import Any

_DOTTED_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
REWARD_TYPES = ("exact_match", "regex", "math", "python", "judge", "human")
# Rewards the web app gives after an episode ends (an LLM judge, a person), not the rollout driver.
DEFERRED_REWARD_TYPES = ("judge", "human")
_REWARD_KEYS = {
    "exact_match": {"type"},
    "math": {"type"},
    "regex": {"type", "pattern", "flags"},
    "python": {"type", "path"},
    "judge": {
        "type",
        "rubric",
        "base_url",
        "model",
        "api_key_env",
        "api_key",
        "api_key_encrypted",
        "relative",
        "timeout_s",
        "max_tokens",
        "judge",
    },
    "human": {"type", "timeout_s"},
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def reward_spec_errors(spec: Any) -> list[str]:
    """Messages describing what is wrong with a reward spec (empty when it is valid)."""
    if not isinstance(spec, dict):
        return ['reward must be an object such as {"type": "exact_match"}.']
    kind = spec.get("type")
    if kind not in REWARD_TYPES:
        return [f"reward.type must be one of {', '.join(REWARD_TYPES)}; got {kind!r}."]
    extra = sorted(set(spec) - _REWARD_KEYS[kind])
    if extra:
        allowed = ", ".join(sorted(_REWARD_KEYS[kind]))
        return [f"Unknown reward keys for a {kind} reward: {', '.join(extra)}. Allowed: {allowed}."]
    if kind == "regex":
        pattern = spec.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            return [
                'A regex reward needs "pattern", a regular expression the completion must match.'
            ]
        try:
            re.compile(pattern)
        except re.error as exc:
            return [f"reward.pattern is not a valid regular expression: {exc}."]
    if kind == "python":
        path = spec.get("path")
        if not isinstance(path, str) or not _DOTTED_PATH.match(path):
            return ['A python reward needs "path" as "module.submodule:function".']
    if kind == "judge":
        return _judge_errors(spec)
    if kind == "human":
        return _positive_number(spec, "timeout_s", "seconds a session waits for feedback")
    return []


def _judge_errors(spec: dict) -> list[str]:
    errors = []
    if not isinstance(spec.get("rubric"), str) or not spec["rubric"].strip():
        errors.append('A judge reward needs "rubric": the criteria the judge scores an answer by.')
    if "judge" in spec:
        if spec["judge"] != "self":
            return [*errors, 'reward.judge can only be "self" (the run\'s own base model).']
        endpoint = sorted({"base_url", "model", "api_key", "api_key_env"} & set(spec))
        if endpoint:
            errors.append(
                f"A self judge is the run's own model on its own servers: leave out"
                f" {', '.join(endpoint)}."
            )
        return errors + _judge_limits(spec)
    if not isinstance(spec.get("model"), str) or not spec["model"].strip():
        errors.append('A judge reward needs "model": the judge\'s model name at base_url.')
    base_url = spec.get("base_url")
    if not isinstance(base_url, str) or not re.match(r"^https?://[^\s/]+", base_url):
        errors.append(
            'A judge reward needs "base_url": an OpenAI-compatible endpoint such as'
            ' "https://api.openai.com/v1", or "judge": "self" for the run\'s own base model.'
        )
    keys = [name for name in ("api_key_env", "api_key", "api_key_encrypted") if name in spec]
    if len(keys) > 1:
        errors.append(f"Give the judge's key one way, not {' and '.join(keys)}.")
    env = spec.get("api_key_env")
    if env is not None and (not isinstance(env, str) or not _ENV_NAME.match(env)):
        errors.append("reward.api_key_env must name an environment variable, e.g. JUDGE_API_KEY.")
    for name in ("api_key", "api_key_encrypted"):
        if name in spec and (not isinstance(spec[name], str) or not spec[name].strip()):
            errors.append(f"reward.{name} must be a non-empty string.")
    return errors + _judge_limits(spec)


def _judge_limits(spec: dict) -> list[str]:
    errors = []
    if "relative" in spec and not isinstance(spec["relative"], bool):
        errors.append("reward.relative must be true or false.")
    errors += _positive_number(spec, "timeout_s", "seconds one judge call may take")
    max_tokens = spec.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 16
    ):
        errors.append("reward.max_tokens must be a whole number of at least 16.")
    return errors


def _positive_number(spec: dict, name: str, what: str) -> list[str]:
    value = spec.get(name)
    if value is None:
        return []
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        return [f"reward.{name} must be a positive number of {what}; got {value!r}."]
    return []


# What an absent key means (the web app's scorer reads them through ``reward_setting``).
REWARD_DEFAULTS: dict[str, dict[str, Any]] = {
    "judge": {"relative": False, "timeout_s": 60.0, "max_tokens": 512},
    "human": {"timeout_s": 86400.0},
}


def reward_setting(spec: dict, name: str) -> Any:
    """``spec[name]``, or its type's default when absent."""
    if name in spec:
        return spec[name]
    return REWARD_DEFAULTS.get(spec.get("type", ""), {}).get(name)


def reward_is_deferred(spec: Any) -> bool:
    """The web app scores these episodes after they end (judge, human); the driver does not."""
    return isinstance(spec, dict) and spec.get("type") in DEFERRED_REWARD_TYPES


REWARD_TYPES_DOC = """
## Reward types

`reward` is an object whose `type` picks how an episode is scored.

| type | keys | scored |
|---|---|---|
| `exact_match` | — | by the rollout driver: 1.0 when the answer equals the row's `answer` (whitespace-normalised) |
| `regex` | `pattern`, `flags` (any of `imsx`) | by the rollout driver: 1.0 when `pattern` matches (and its `answer` group equals the row's `answer`) |
| `math` | — | by the rollout driver: 1.0 when math-verify finds the answer equivalent to the row's `answer` |
| `python` | `path` (`module:function`) | by the rollout driver: your `fn(prompt, completion, answer, metadata) -> float`, in a module the operator allows (`STEEP_REWARD_MODULES`; Steep's own `rl_core.rewards` / `rl_core.toy` `*_reward_fn` always) |
| `judge` | see below | by the web app's worker, after the episode ends: an LLM judge reads the conversation and the rubric |
| `human` | `timeout_s` (default `86400`) | by people: feedback on the session's page, the review queue or `POST /api/v1/sessions/<id>/feedback/` |

### `judge`

| key | default | meaning |
|---|---|---|
| `rubric` | required | The criteria, in words, that the judge scores an answer by. |
| `judge` | — | `"self"`: the run's own base model judges, on the run's own inference servers (a LoRA run's base weights; a full-weight run's servers hold the current policy, so it judges itself as it learns). Then leave out `base_url`, `model` and the key. While the run has no server up, judging waits. |
| `base_url` | required | Any OpenAI-compatible endpoint, e.g. `https://api.openai.com/v1` or a vLLM/SGLang server's `/v1`. Loopback, private, link-local and the instance's own addresses only where the operator allows them (`STEEP_OUTBOUND_ALLOW`); redirects are not followed. |
| `model` | required | The judge model's name at `base_url`. |
| `api_key_env` | — | The name of an environment variable of the worker that holds the judge's key (the key never enters the database). |
| `api_key` | — | The key itself: stored encrypted (Fernet, keyed from `SECRET_KEY`) as `api_key_encrypted` and never shown again by the API or the dashboard. Give one of `api_key_env` / `api_key`, or neither for an endpoint without keys. |
| `relative` | `false` | Score the answers of a group together, ranked against each other (RULER-style): one call per group (dataset mode: the `group_size` answers to one prompt; online mode: the sessions with the same `task_id`). |
| `timeout_s` | `60` | Seconds one judge call may take before it counts as an outage. |
| `max_tokens` | `512` | The judge's answer budget. |

Each ended session without a reward (dataset mode: every episode) is judged once, by the
worker's `rewards.judge` task (every `STEEP_JUDGE_INTERVAL_S` seconds, at most
`STEEP_JUDGE_CONCURRENCY` calls at once, off the web server's event loop). The judge must
answer JSON, `{"score": 0..1, "reason": "..."}` (relative: `{"scores": [{"id", "score",
"reason"}, ...]}`), checked against a JSON schema; an answer that fails is asked again once,
then the session is marked *unscored* with the reason and never trained. An unreachable judge
(a connection error, a timeout, any HTTP error status, a missing key variable, a self judge
with no server up) is not a verdict: the session stays waiting and is tried again with
exponential backoff (10 s doubling, at most 10 minutes), so an outage delays training and
loses nothing. In dataset mode an unscored or dropped episode gives its staleness slot back. Verdicts are cached by the hash
of the judge, the rubric and the conversation: a repeat costs no call. Calls, cache hits,
tokens and latency are shown per run on its page.

### `human`

A session that ends without a reward waits for people's feedback. Feedback becomes a reward
by one rule: the `score` given (0 to 1), else 1.0 for thumbs up and 0.0 for thumbs down (a
comment alone sets none). Feedback on a turn rewards that turn; feedback on the session rewards
its last turn (the outcome reward). The latest feedback wins, until the trajectory is claimed
for training. A session that gets none within `timeout_s` of its end is dropped, counted on the
run's page with the reason. Feedback works the same on the sessions of any run.
"""
