"""One call to an LLM judge: the prompt, the call (the official ``openai`` SDK, any
OpenAI-compatible ``base_url``), and the answer checked against a JSON schema.

No database here: ``webapp.rewards.services`` decides what to judge, caches verdicts and
records what calls cost. ``judge_answers`` is called from worker threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema

from rl_core.reward_specs import reward_setting
from rl_core.sources import screened_client
from webapp.rewards.secrets import KeyUnavailable, judge_api_key
from webapp.runs.sources import source_rules

if TYPE_CHECKING:
    import openai

# Bumped when the prompt or the schema changes, so old cached verdicts stop matching.
PROMPT_VERSION = "1"

ABSOLUTE_SCHEMA = {
    "type": "object",
    "required": ["score"],
    "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "reason": {"type": "string"},
    },
}


def relative_schema(n: int) -> dict:
    return {
        "type": "object",
        "required": ["scores"],
        "properties": {
            "scores": {
                "type": "array",
                "minItems": n,
                "maxItems": n,
                "items": {
                    "type": "object",
                    "required": ["id", "score"],
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": n},
                        "score": {"type": "number", "minimum": 0, "maximum": 1},
                        "reason": {"type": "string"},
                    },
                },
            }
        },
    }


SYSTEM = (
    "You are a strict, fair judge of an AI assistant's answers. Score by the rubric only."
    " Reply with one JSON object and nothing else."
)


@dataclasses.dataclass
class Verdict:
    scores: list[float]
    reasons: list[str]


@dataclasses.dataclass
class CallResult:
    """What one judging took: a verdict, or why there is none.

    ``outage``: the judge could not be asked (unreachable, 429/5xx, a missing key): try again
    later. Otherwise no verdict means the answer failed its schema on both attempts.
    """

    verdict: Verdict | None
    error: str = ""
    outage: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0


def transcript(messages: list[dict], answer: str) -> str:
    """A conversation as the judge reads it: each message, then the answer being judged."""
    lines = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
        lines.append(f"[{message.get('role', 'user')}] {content or ''}")
    lines.append(f"[assistant, the answer to judge] {answer}")
    return "\n".join(lines)


def content_hash(spec: dict, transcripts: list[str], *, judge_id: str = "") -> str:
    """Everything that decides a verdict: the judge, the rubric, the mode and the answers.
    ``judge_id`` names a self judge's model (its run and weights); else base_url and model do."""
    key = [
        PROMPT_VERSION,
        judge_id or spec["base_url"].rstrip("/"),
        judge_id or spec["model"],
        spec["rubric"],
        bool(reward_setting(spec, "relative")),
        transcripts,
    ]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def judge_messages(spec: dict, transcripts: list[str]) -> list[dict]:
    if len(transcripts) == 1 and not reward_setting(spec, "relative"):
        task = (
            f"Rubric:\n{spec['rubric']}\n\nConversation:\n{transcripts[0]}\n\n"
            'Reply as {"score": <a number from 0 (worst) to 1 (best)>, "reason": "<one sentence>"}.'
        )
    else:
        answers = "\n\n".join(f"### Answer {i}\n{t}" for i, t in enumerate(transcripts, 1))
        task = (
            f"Rubric:\n{spec['rubric']}\n\n{len(transcripts)} answers to the same task follow."
            f" Score each against the rubric and against each other.\n\n{answers}\n\n"
            'Reply as {"scores": [{"id": <answer number>, "score": <0 to 1>, "reason":'
            ' "<one sentence>"}, ...]} with one entry per answer.'
        )
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_verdict(text: str, n: int, relative: bool) -> Verdict:
    """The judge's reply as a verdict of ``n`` scores; ValueError saying what is wrong."""
    body = text.strip()
    if fenced := _FENCE.match(body):
        body = fenced.group(1)
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the judge's reply is not JSON ({exc.msg}): {text[:200]!r}") from None
    schema = relative_schema(n) if relative else ABSOLUTE_SCHEMA
    try:
        jsonschema.validate(data, schema)
    except jsonschema.ValidationError as exc:
        raise ValueError(f"the judge's reply does not fit its schema: {exc.message}") from None
    if not relative:
        return Verdict([float(data["score"])], [str(data.get("reason", ""))])
    by_id = {item["id"]: item for item in data["scores"]}
    if len(by_id) != n:
        raise ValueError("the judge's reply scores some answers twice and others not at all")
    return Verdict(
        [float(by_id[i]["score"]) for i in range(1, n + 1)],
        [str(by_id[i].get("reason", "")) for i in range(1, n + 1)],
    )


@dataclasses.dataclass
class SelfJudge:
    """The run's own model as the judge: its healthy inference servers (SGLang's ``/generate``),
    asked in order until one answers, and its base model's chat tokenizer. No ``lora_path``: a
    LoRA run's base weights answer."""

    server_urls: list[str]
    tokenizer: Any  # rl_core.chat.ChatTokenizer


class _Outage(Exception):
    pass


class Unavailable(Exception):
    """A self judge cannot be asked now (no server up, no tokenizer): an outage."""


def _ask_endpoint(client: openai.OpenAI, spec: dict, messages: list[dict]) -> tuple[str, int, int]:
    import openai  # here, not at the top: it takes a second to load, and most callers never ask

    try:
        reply = client.chat.completions.create(
            model=spec["model"],
            messages=messages,  # type: ignore[arg-type]
            temperature=0.0,
            max_tokens=int(reward_setting(spec, "max_tokens")),
        )
    except (openai.APIConnectionError, openai.APITimeoutError) as exc:
        # The SDK says "Connection error."; its cause says which (a refused host names its setting).
        raise _Outage(f"the judge is unreachable: {exc.__cause__ or exc}") from None
    except openai.APIStatusError as exc:
        raise _Outage(f"the judge answered HTTP {exc.status_code}: {exc.message}") from None
    usage = reply.usage
    text = (reply.choices[0].message.content or "") if reply.choices else ""
    if usage is None:
        return text, 0, 0
    return text, usage.prompt_tokens or 0, usage.completion_tokens or 0


def _ask_self(judge_: SelfJudge, spec: dict, messages: list[dict]) -> tuple[str, int, int]:
    input_ids = judge_.tokenizer.encode(judge_.tokenizer.render(messages))
    body = {
        "input_ids": input_ids,
        "sampling_params": {
            "max_new_tokens": int(reward_setting(spec, "max_tokens")),
            "temperature": 0.0,
        },
    }
    failures = []
    for url in judge_.server_urls:  # the next server when one is down or refuses
        try:
            response = httpx.post(
                f"{url.rstrip('/')}/generate",
                json=body,
                timeout=float(reward_setting(spec, "timeout_s")),
            )
        except httpx.HTTPError as exc:
            failures.append(f"{url} is unreachable: {exc}")
            continue
        if response.status_code != 200:
            failures.append(f"{url} answered HTTP {response.status_code}")
            continue
        output_ids = response.json().get("output_ids") or []
        return judge_.tokenizer.decode(output_ids), len(input_ids), len(output_ids)
    raise _Outage("no inference server of the run answered: " + "; ".join(failures))


def judge_answers(
    spec: dict, transcripts: list[str], *, self_judge: SelfJudge | None = None
) -> CallResult:
    """Ask the judge for ``transcripts``' scores: a malformed reply is asked again once."""
    relative = len(transcripts) > 1 or bool(reward_setting(spec, "relative"))
    messages = judge_messages(spec, transcripts)
    if self_judge is not None:

        def ask() -> tuple[str, int, int]:
            return _ask_self(self_judge, spec, messages)
    else:
        import openai

        try:
            client = openai.OpenAI(
                base_url=spec["base_url"],
                api_key=judge_api_key(spec),
                timeout=float(reward_setting(spec, "timeout_s")),
                max_retries=0,  # our backoff, not the SDK's, decides when to ask again
                # Each request's host is screened as it is sent, and no redirect is followed.
                http_client=screened_client(source_rules(), setting="reward.base_url"),
            )
        except KeyUnavailable as exc:
            return CallResult(None, str(exc), outage=True)

        def ask() -> tuple[str, int, int]:
            return _ask_endpoint(client, spec, messages)

    result = CallResult(None)
    for _attempt in range(2):
        started = time.perf_counter()
        try:
            text, prompt_tokens, completion_tokens = ask()
        except _Outage as exc:
            return _outage(result, str(exc))
        finally:
            result.latency_ms += (time.perf_counter() - started) * 1000
        result.prompt_tokens += prompt_tokens
        result.completion_tokens += completion_tokens
        try:
            result.verdict = parse_verdict(text, len(transcripts), relative)
            result.error = ""
            return result
        except ValueError as exc:
            result.error = str(exc)
    return result


def _outage(result: CallResult, error: str) -> CallResult:
    result.error, result.outage = error, True
    return result


__all__ = [
    "CallResult",
    "SelfJudge",
    "Verdict",
    "content_hash",
    "judge_answers",
    "parse_verdict",
    "transcript",
]
