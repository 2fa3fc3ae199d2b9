"""SGLang's native HTTP API as the inference client reads it (the torch engine speaks it too).

What a generation returns (``GenerateResult``, ``GenerateChunk``), how one
``/generate`` answer is parsed (``parse_segment``), the weight versions servers
report, and the errors a server answers with. Plain data and parsing: no I/O,
no torch.

Field names were checked against SGLang's ``python/sglang/srt/entrypoints/http_server.py``,
``python/sglang/srt/managers/io_struct.py`` and ``tokenizer_manager.py``
(``meta_info`` keys, ``[logprob, token_id, text]`` triples).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class InferenceError(Exception):
    """The server refused or failed a request. ``status`` is the HTTP status, if any."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


class InferenceUnavailable(InferenceError):
    """The server could not be reached, or answered 503: try another one, or later."""


def parse_weight_version(value: Any) -> int:
    """Steep names weight versions with integers (the policy version); parse the server's string.

    SGLang reports ``"default"`` when launched without ``--weight-version``; that is
    the initial policy, version 0.
    """
    if isinstance(value, bool):
        raise InferenceError(f"weight_version {value!r} is not an integer policy version")
    if isinstance(value, int):
        return value
    if value is None or value == "default":
        return 0
    try:
        return int(str(value).strip())
    except ValueError:
        raise InferenceError(
            f"weight_version {value!r} is not an integer policy version; launch servers with "
            "--weight-version 0 and pass integer versions to update_weights_from_disk"
        ) from None


@dataclass
class GenerateResult:
    """One finished generation, possibly stitched from several resumed segments. Plain data.

    ``output_logprobs[i]`` is the behaviour log-prob of ``output_ids[i]`` and
    ``versions[i]`` the weight version that produced it; the lists have equal length
    (``output_logprobs`` is empty when logprobs were not requested).
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort" (abort: the resume budget ran out)
    matched_stop: int | str | None  # the stop token id or stop string that ended it
    prompt_tokens: int  # of the original prompt
    text: str  # the servers' decoded segments joined; decode output_ids when exactness matters
    num_segments: int = 1  # 1 + number of resumes after aborts
    # Per token: (logprob, id), best first; None when not requested.
    top_logprobs: list[list[tuple[float, int]]] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict."""
        return {
            "rid": self.rid,
            "output_ids": list(self.output_ids),
            "output_logprobs": list(self.output_logprobs),
            "versions": list(self.versions),
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
            "prompt_tokens": self.prompt_tokens,
            "text": self.text,
            "num_segments": self.num_segments,
            "top_logprobs": None
            if self.top_logprobs is None
            else [[list(x) for x in row] for row in self.top_logprobs],
        }


@dataclass
class GenerateChunk:
    """New tokens from a streaming generation; the last chunk has ``finish_reason`` set."""

    output_ids: list[int]
    output_logprobs: list[float]
    versions: list[int]
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    # Set when the server reported the versions of tokens it had already streamed only at the
    # end (vLLM's stream does): the version of every token of the generation so far, which
    # replaces what the earlier chunks said.
    revised_versions: list[int] | None = None


def token_versions(meta: dict[str, Any], n: int) -> list[int]:
    """The weight version of each of ``n`` output tokens.

    From ``meta_info.weight_versions`` (SGLang's spans ``{"version", "start", "end"}`` over
    output token indices, present when a weight update landed while the request ran)
    when the server reports it; else every token gets ``meta_info.weight_version``.
    """
    spans = meta.get("weight_versions")
    last = parse_weight_version(meta.get("weight_version"))
    if not isinstance(spans, list) or not spans:
        return [last] * n
    versions: list[int] = []
    try:
        for span in spans:
            end = min(int(span["end"]), n)
            versions += [parse_weight_version(span["version"])] * max(0, end - len(versions))
    except (KeyError, TypeError, ValueError) as exc:
        raise InferenceError(f"malformed meta_info.weight_versions ({exc!r})", body=meta) from None
    return versions + [last] * (n - len(versions))


def parse_segment(
    data: dict[str, Any], *, return_logprob: bool, top_n: int, start: int = 0
) -> tuple[list[int], list[float], list[int], dict | None, list]:
    """Parse one /generate response: ids, logprobs, versions (per token), finish_reason, top logprobs.

    With ``start``, only the tokens from that index on: a streamed answer carries the whole
    segment in every event, and converting all of it each time would cost the square of the
    answer's length.
    """
    try:
        raw_ids = data["output_ids"]
        meta = data["meta_info"]
        ids = [int(t) for t in raw_ids[start:]]
    except (KeyError, TypeError, ValueError) as exc:
        raise InferenceError(f"malformed /generate response (missing {exc})", body=data) from None
    n = len(raw_ids)
    logprobs: list[float] = []
    if return_logprob:
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != n:
            raise InferenceError(
                f"/generate returned {n} output ids but {len(entries)} output_token_logprobs",
                body=data,
            )
        logprobs = [float(e[0]) for e in entries[start:]]
    top: list[list[tuple[float, int]]] = []
    if top_n:
        top = [
            [(float(e[0]), int(e[1])) for e in row or []]
            for row in (meta.get("output_top_logprobs") or [])[start:]
        ]
    return (
        ids,
        logprobs,
        token_versions(meta, n)[start:] if start else token_versions(meta, n),
        meta.get("finish_reason"),
        top,
    )


def error_from_answer(status: int, text: str, what: str) -> InferenceError:
    """The error for a 4xx/5xx answer: SGLang's error JSON, or the text; 503 is unavailable."""
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    message = body
    if isinstance(body, dict):
        err = body.get("error")
        message = (
            body.get("message")
            or body.get("error_message")  # SGLang's LoRAUpdateOutput
            or (err.get("message") if isinstance(err, dict) else err)
            or body
        )
    cls = InferenceUnavailable if status == 503 else InferenceError
    return cls(f"{what} -> {status}: {message}", status=status, body=body)
