"""A chat-completion request: its body parsed and validated, and what its messages continue.

``read_chat_request`` is the chat path's first step: the JSON body (``parse_json_body``, which
every agent endpoint reads its body with), checked field by field into a ``ChatRequest``, and
its fingerprint. Whether a request's messages continue an earlier turn (``continued_choice``
of a ``PreviousTurn``) is decided here too, by what reaches the model (``normalize_message``).
Pure: no I/O, no Django models.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from rl_core.jsonbytes import json_bytes
from webapp.gateway.errors import bad_request

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 16
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 512


@dataclass
class ChatRequest:
    messages: list[dict]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # not OpenAI's; SGLang's and vLLM's extension (the SDK's extra_body)
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict] | None = None
    tool_choice: Any = "auto"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # SGLang's and vLLM's extension, like top_k
    min_p: float = 0.0  # SGLang's and vLLM's extension, like top_k
    min_tokens: int = 0  # vLLM's extension (SGLang's min_new_tokens): no stop before this many
    # The request's model: ignored, except "policy/<role>" on a multi-agent run (gateway.roles).
    model: str = ""
    # The tools the template renders: none when tool_choice is "none".
    rendered_tools: list[dict] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.rendered_tools = None if self.tool_choice == "none" else self.tools

    def fingerprint(self) -> str:
        """Identifies a re-sent request (an SDK retry): same messages, tools and sampling settings."""
        payload = {
            "messages": [_normal(m) for m in self.messages],
            "tools": self.tools,
            "sampling": [
                self.max_tokens,
                self.temperature,
                self.top_p,
                self.top_k,
                self.n,
                self.seed,
                self.stop,
                self.presence_penalty,
                self.frequency_penalty,
                self.repetition_penalty,
                self.min_p,
                self.min_tokens,
            ],
        }
        if self.model.startswith("policy/"):  # another role's answer is another request
            payload["model"] = self.model
        canonical = json_bytes(payload, sort_keys=True, default=str)
        return hashlib.sha256(canonical).hexdigest()

    def sampling_params(self, *, max_new_tokens: int, stop_token_ids: list[int]) -> dict:
        """SGLang's ``sampling_params`` names."""
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop_token_ids": stop_token_ids,
        }
        if self.top_k > 0:
            params["top_k"] = self.top_k
        if self.stop:
            params["stop"] = self.stop
        if self.presence_penalty:
            params["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            params["frequency_penalty"] = self.frequency_penalty
        if self.repetition_penalty != 1.0:
            params["repetition_penalty"] = self.repetition_penalty
        if self.min_p:
            params["min_p"] = self.min_p
        if self.min_tokens:
            params["min_new_tokens"] = self.min_tokens
        return params


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(
            f"'{name}' must be a number; got {type(value).__name__}.",
            param=name,
            code="invalid_type",
        )
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}; got {value}.", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(
            f"'{name}' must be an integer; got {type(value).__name__}.",
            param=name,
            code="invalid_type",
        )
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}; got {value}.", param=name)
    return value


def _top_k(body: dict) -> int:
    top_k = _integer(body, "top_k", -1, -1, 1_000_000_000)
    return -1 if not top_k or top_k < 0 else top_k  # 0 and -1 both mean no top-k


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false.", param=name, code="invalid_type")
    return value


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request(
            "'messages' is required: a list of {role, content} objects.",
            param="messages",
            code="missing_required_parameter",
        )
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "'messages' must be a non-empty list.", param="messages", code="invalid_type"
        )
    for i, message in enumerate(messages):
        if (
            type(message) is dict
            and type(message.get("content")) is str
            and (message.get("role") in ROLES and message.get("tool_calls") is None)
        ):
            continue  # the common message, checked in one line (a long session sends hundreds)
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object.", param=param, code="invalid_type")
        if message.get("role") not in ROLES:
            raise bad_request(
                f"{param}.role must be one of {', '.join(sorted(ROLES))}.", param=f"{param}.role"
            )
        content = message.get("content")
        if content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise bad_request(
                f"{param}.content is required.",
                param=f"{param}.content",
                code="missing_required_parameter",
            )
        if content is not None and not isinstance(content, str | list):
            raise bad_request(
                f"{param}.content must be a string or a list of content parts.",
                param=f"{param}.content",
                code="invalid_type",
            )
        if isinstance(content, list):
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise bad_request(
                        f"{param}.content: only text parts are supported.", param=f"{param}.content"
                    )
        if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], list):
            raise bad_request(
                f"{param}.tool_calls must be a list.",
                param=f"{param}.tool_calls",
                code="invalid_type",
            )
    return messages


def read_chat_request(body: bytes, content_type: str) -> tuple[ChatRequest, str]:
    """The request a chat-completions body holds, validated (a 400 in OpenAI's shape when it is
    not), and its fingerprint (``ChatRequest.fingerprint``)."""
    chat = parse_chat_request(parse_json_body(body, content_type))
    return chat, chat.fingerprint()


# Nineteen digits in a row: a number that may not fit in 64 bits (or digits in a string).
_DIGITS = bytes(1 if 0x30 <= byte <= 0x39 else 0 for byte in range(256))
_LONG_RUN = b"\x01" * 19


def _has_long_number(body: bytes) -> bool:
    return body.translate(_DIGITS).find(_LONG_RUN) >= 0  # both in C: ~5 us for 11 KB


def parse_json_body(body: bytes, content_type: str) -> object:
    """An agent endpoint's JSON body; a 400 for another media type, invalid JSON or a string
    the database cannot store (``check_storable``)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type not in ("application/json", ""):
        raise bad_request(
            "Send the body as JSON (Content-Type: application/json).", code="invalid_content_type"
        )
    try:
        if _has_long_number(body):  # orjson reads integers over 64 bits as floats
            raise orjson.JSONDecodeError("", "", 0)
        parsed = orjson.loads(body or b"null")  # ~3x json's on a long session's history
    except orjson.JSONDecodeError:
        try:  # what orjson refuses or changes and json reads (NaN, lone surrogates, 2**70)
            parsed = json.loads(body or b"null")
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise bad_request(f"The body is not valid JSON: {exc}.", code="invalid_json") from None
    if not _plainly_storable(body):
        check_storable(parsed)
    return parsed


def _plainly_storable(body: bytes) -> bool:
    """True when no string parsed from ``body`` can hold a NUL or a lone surrogate, which
    ``check_storable`` looks for by walking every value. ``json.loads`` reads a body with no
    zero byte and no UTF-16/32 byte order mark as UTF-8; there a NUL or a surrogate comes
    only from a ``\\u`` escape or from the UTF-8 bytes of a surrogate (lead byte 0xED)."""
    return (
        b"\\u" not in body
        and b"\xed" not in body
        and b"\x00" not in body
        and not body.startswith((b"\xff\xfe", b"\xfe\xff"))
    )


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    messages = _messages(body)
    if "model" in body and not isinstance(body["model"], str):
        raise bad_request("'model' must be a string.", param="model", code="invalid_type")
    max_tokens = _integer(body, "max_completion_tokens", None, 1, 1_000_000)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, 1_000_000)
    stop = body.get("stop")
    if stop is None:
        stop_list: list[str] = []
    elif isinstance(stop, str):
        stop_list = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stop_list = list(stop)
    else:
        raise bad_request(
            "'stop' must be a string or a list of up to 4 strings.",
            param="stop",
            code="invalid_type",
        )
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request(
            "'stream_options' must be an object.", param="stream_options", code="invalid_type"
        )
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        ):
            raise bad_request(
                "'tools' must be a list of {type: 'function', function: {name, description?, parameters?}}.",
                param="tools",
                code="invalid_type",
            )
    tool_choice = body.get("tool_choice", "auto")
    if not (tool_choice in ("none", "auto", "required") or isinstance(tool_choice, dict)):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or an object naming a function.",
            param="tool_choice",
        )
    _refuse_logit_bias(body)
    logprobs = _bool(body, "logprobs")
    top_logprobs = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    min_tokens = _integer(body, "min_tokens", 0, 0, 1_000_000) or 0
    if min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({min_tokens}) cannot exceed max_tokens ({max_tokens}).",
            param="min_tokens",
        )
    return ChatRequest(
        messages=messages,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_top_k(body),
        n=_integer(body, "n", 1, 1, MAX_N) or 1,
        seed=_integer(body, "seed", None, -(2**63), 2**63 - 1),
        stop=stop_list,
        stream=_bool(body, "stream"),
        include_usage=bool(stream_options.get("include_usage")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        tools=tools,
        tool_choice=tool_choice,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_repetition_penalty(body),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        min_tokens=min_tokens,
        model=body.get("model") or "",
    )


def _repetition_penalty(body: dict) -> float:
    value = _number(body, "repetition_penalty", 1.0, 0.0, 2.0)
    if value == 0.0:
        raise bad_request(
            "'repetition_penalty' must be above 0 (1 is none); got 0.", param="repetition_penalty"
        )
    return value


def _refuse_logit_bias(body: dict) -> None:
    # Every logit_bias would need the tokenizer-level ids of this model and changes the
    # sampled distribution in a way neither engine reports per token: refused, not ignored.
    if body.get("logit_bias") not in (None, {}):
        raise bad_request(
            "'logit_bias' is not supported by this gateway; leave it out.",
            param="logit_bias",
            code="unsupported_parameter",
        )


# NUL, and the lone surrogates a JSON escape like "\ud800" yields: not text PostgreSQL (or UTF-8) can hold.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def check_storable(body: Any) -> None:
    """Refuse a parsed body holding a string the database cannot store, before anything runs."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if _UNSTORABLE.search(value):
                raise bad_request(
                    "The body contains a NUL character or an unpaired surrogate escape "
                    "(\\ud800-\\udfff), which text cannot hold.",
                    code="invalid_value",
                )
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _normal(message: dict) -> dict:
    """``normalize_message``, without building a copy of a message already in that form."""
    if len(message) == 2 and type(message.get("content")) is str and "role" in message:
        return message
    return normalize_message(message)


def normalize_message(message: dict) -> dict:
    """The parts of a message that reach the model, in a canonical form for comparisons.

    SDKs echo an assistant message back with extra keys (refusal, audio, annotations…)
    and ``None`` for absent ones; only role, content, tool calls and tool ids matter.
    """
    out: dict[str, Any] = {
        "role": message.get("role"),
        "content": content_text(message.get("content")),
    }
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = fn.get("arguments", "")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except ValueError:
                pass
        calls.append({"name": fn.get("name"), "arguments": arguments})
    if calls:
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


# --- What the messages continue ------------------------------------------------------------


@dataclass
class PreviousTurn:
    """A recorded turn as the next one continues it (``webapp.gateway.prompts``)."""

    messages: list[dict]
    tools: list[dict] | None
    input_ids: list[int]
    choices: list[dict]  # per choice: {"output_ids": [...], "message": {...as returned}}
    key: str | None = None  # its interaction id, under which its prompt's text may be remembered
    turn: int | None = None  # its number in the session


def continued_choice(messages: list[dict], previous: PreviousTurn) -> int | None:
    """Index of the previous turn's choice that ``messages`` continue with, if they extend it."""
    k = len(previous.messages)
    if len(messages) <= k:
        return None
    # Equal messages normalise equally: the usual re-sent history costs one comparison.
    if messages[:k] != previous.messages and [normalize_message(m) for m in messages[:k]] != [
        normalize_message(m) for m in previous.messages
    ]:
        return None
    answer = normalize_message(messages[k])
    for index, choice in enumerate(previous.choices):
        if normalize_message(choice["message"]) == answer:
            return index
    return None
