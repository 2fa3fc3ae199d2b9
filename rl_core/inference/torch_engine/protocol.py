"""SGLang's request and response bodies, as the torch engine parses and answers them.

Field names follow SGLang's ``io_struct.py`` (``GenerateReqInput``,
``PauseGenerationReqInput``, ``UpdateWeightFromDiskReqInput``, ...) and the
``/generate`` answer its ``tokenizer_manager.py`` builds. Every parser raises
``BadRequest`` naming the bad field; the server answers it with HTTP 400.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class BadRequest(ValueError):
    """A request the engine refuses; answered with HTTP 400 and SGLang's error JSON."""


# --------------------------------------------------------------------------- /generate


@dataclass
class SamplingParams:
    """The subset of SGLang's ``sampling_params`` the torch engine implements.

    Names and defaults follow SGLang's ``SamplingParams``. Parameters SGLang has but
    this engine does not implement are accepted only at their neutral value, so a
    request never silently gets different semantics from the two backends.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    # OpenAI's additive penalties and the multiplicative one, over the tokens generated so
    # far (penalties.py); the reported logprob is of the penalised distribution.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


# Accepted only when equal to these neutral values.
_NEUTRAL_PARAMS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "stop_regex": (None, []),
    "logit_bias": (None, {}),
    "custom_params": (None,),
}
_IGNORED_PARAMS = {"spaces_between_special_tokens", "stream_interval"}


def as_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}.")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}.")
    return value


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}.")
    return float(value)


def as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}.")
    return value


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate a ``sampling_params`` object; raise ``BadRequest`` naming the bad field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be a JSON object.")
    p = SamplingParams()
    for key, value in raw.items():
        if key in _NEUTRAL_PARAMS:
            if value not in _NEUTRAL_PARAMS[key]:
                raise BadRequest(
                    f"sampling_params.{key}={value!r} is not supported by the torch engine "
                    f"(only {_NEUTRAL_PARAMS[key][0]!r}); use the sglang backend for it."
                )
        elif key in _IGNORED_PARAMS:
            pass
        elif key == "max_new_tokens":
            if value is not None:
                p.max_new_tokens = as_int(key, value, minimum=0)
        elif key == "min_new_tokens":
            p.min_new_tokens = as_int(key, value, minimum=0)
        elif key == "temperature":
            p.temperature = as_float(key, value)
            if p.temperature < 0:
                raise BadRequest(f"temperature must be >= 0, got {value}.")
        elif key == "top_p":
            p.top_p = as_float(key, value)
            if not 0.0 < p.top_p <= 1.0:
                raise BadRequest(f"top_p must be in (0, 1], got {value}.")
        elif key == "top_k":
            p.top_k = as_int(key, value, minimum=-1)
        elif key == "min_p":
            p.min_p = as_float(key, value)
            if not 0.0 <= p.min_p <= 1.0:
                raise BadRequest(f"min_p must be in [0, 1], got {value}.")
        elif key in ("presence_penalty", "frequency_penalty"):
            setattr(p, key, as_float(key, value))
            if not -2.0 <= getattr(p, key) <= 2.0:
                raise BadRequest(f"{key} must be in [-2, 2], got {value}.")
        elif key == "repetition_penalty":
            p.repetition_penalty = as_float(key, value)
            if not 0.0 < p.repetition_penalty <= 2.0:
                raise BadRequest(f"repetition_penalty must be in (0, 2], got {value}.")
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if stops is None:
                stops = []
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise BadRequest("stop must be a non-empty string or a list of non-empty strings.")
            p.stop = list(stops)
        elif key == "stop_token_ids":
            ids = value or []
            if not isinstance(ids, list):
                raise BadRequest("stop_token_ids must be a list of token ids.")
            p.stop_token_ids = [as_int("stop_token_ids[]", t, minimum=0) for t in ids]
            if any(t >= vocab_size for t in p.stop_token_ids):
                raise BadRequest(f"stop_token_ids must be < vocab size {vocab_size}.")
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            setattr(p, key, as_bool(key, value))
        elif key == "sampling_seed":
            p.sampling_seed = None if value is None else as_int(key, value)
        else:
            raise BadRequest(f"Unknown sampling parameter {key!r}.")
    if p.min_new_tokens > p.max_new_tokens:
        raise BadRequest("min_new_tokens must be <= max_new_tokens.")
    return p


class GenerateRequest:
    """One /generate request and its progress; mutated only by the scheduler thread."""

    def __init__(
        self,
        *,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        return_logprob: bool,
        logprob_start_len: int,
        top_logprobs_num: int,
        return_text_in_logprobs: bool,
        stream: bool,
        lora_path: str | None = None,
    ):
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.return_text_in_logprobs = return_text_in_logprobs
        self.stream = stream
        self.lora_path = lora_path  # the adapter's name (SGLang's field name); None: the base model
        self.adapter: Any = None  # the engine's loaded Adapter while the request holds it
        self.tenant = ""  # the run it is scheduled for (fair.tenant_of), set when queued
        self.created = time.monotonic()
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_versions: list[str] = []  # the weight version that sampled each output token
        self.output_top: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[tuple[float | None, int]] = []
        self.input_top: list[list[tuple[float, int]] | None] = []  # with top_logprobs_num
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.cache_epoch = -1  # the prefix cache's epoch when it was prefilled
        self.finish: dict[str, Any] | None = None
        seed = params.sampling_seed if params.sampling_seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        # Called from the scheduler thread with (payload, final); set by the HTTP handler.
        self.sink: Callable[[dict[str, Any], bool], None] = lambda payload, final: None


def parse_generate_request(body: Any, *, tokenizer: Any, vocab_size: int) -> GenerateRequest:
    """Turn a /generate JSON body into a request, or raise ``BadRequest``."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise BadRequest("Give exactly one of input_ids or text.")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest(
                "Batched requests (a list of texts) are not supported by the torch engine."
            )
        input_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(input_ids, list) or not input_ids:
        raise BadRequest("input_ids must be a non-empty list of token ids.")
    if isinstance(input_ids[0], list):
        raise BadRequest(
            "Batched requests (a list of input_ids lists) are not supported by the torch engine."
        )
    for t in input_ids:
        as_int("input_ids[]", t, minimum=0)
        if t >= vocab_size:
            raise BadRequest(
                f"input_ids contains token id {t}, outside the vocabulary (size {vocab_size})."
            )
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise BadRequest("rid must be a non-empty string.")
    logprob_start_len = body.get("logprob_start_len")
    logprob_start_len = (
        -1
        if logprob_start_len is None
        else as_int("logprob_start_len", logprob_start_len, minimum=-1)
    )
    lora_path = body.get("lora_path")
    if isinstance(lora_path, list) and len(lora_path) == 1:
        lora_path = lora_path[0]
    if lora_path is not None and (not isinstance(lora_path, str) or not lora_path):
        raise BadRequest("lora_path must be the name of a loaded LoRA adapter (a string).")
    top_n = body.get("top_logprobs_num")
    top_n = 0 if top_n is None else as_int("top_logprobs_num", top_n, minimum=0)
    if top_n > vocab_size:
        raise BadRequest(f"top_logprobs_num must be <= vocab size {vocab_size}.")
    return GenerateRequest(
        rid=rid,
        input_ids=list(input_ids),
        params=parse_sampling_params(body.get("sampling_params"), vocab_size),
        return_logprob=as_bool("return_logprob", body.get("return_logprob") or False),
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_n,
        return_text_in_logprobs=as_bool(
            "return_text_in_logprobs", body.get("return_text_in_logprobs") or False
        ),
        stream=as_bool("stream", body.get("stream") or False),
        lora_path=lora_path,
    )


def generate_response(
    req: GenerateRequest, *, tokenizer: Any, weight_version: str
) -> dict[str, Any]:
    """The /generate JSON: ``text``, ``output_ids``, ``meta_info`` as SGLang returns them."""
    p, finish = req.params, req.finish
    text_ids = req.output_ids
    if (
        finish
        and finish.get("type") == "stop"
        and isinstance(finish.get("matched"), int)
        and not p.no_stop_trim
    ):
        text_ids = text_ids[:-1]
    text = tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
    if finish and isinstance(finish.get("matched"), str) and not p.no_stop_trim:
        text = text[: text.find(finish["matched"])] if finish["matched"] in text else text
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": finish,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        # SGLang's per-token record: spans of output tokens by the version that produced them.
        "weight_versions": version_spans(req.output_versions, weight_version),
        "weight_version": req.output_versions[-1] if req.output_versions else weight_version,
        "e2e_latency": time.monotonic() - req.created,
    }
    if req.return_logprob:

        def piece(token: int) -> str | None:
            return tokenizer.decode([token]) if req.return_text_in_logprobs else None

        meta["output_token_logprobs"] = [
            [lp, t, piece(t)] for lp, t in zip(req.output_logprobs, req.output_ids, strict=True)
        ]
        meta["input_token_logprobs"] = [[lp, t, piece(t)] for lp, t in req.input_logprobs]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [[lp, t, piece(t)] for lp, t in row] for row in req.output_top
            ]
            meta["input_top_logprobs"] = [
                None if row is None else [[lp, t, piece(t)] for lp, t in row]
                for row in req.input_top
            ]
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


def version_spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    """``[{"version", "start", "end"}]`` over output token indices, as SGLang's ``weight_versions``."""
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


# --------------------------------------------------------------------------- control endpoints


def check_pause_request(body: Any) -> None:
    """``/pause_generation``: only ``mode: "abort"`` (the default) is implemented."""
    mode = body.get("mode", "abort") if isinstance(body, dict) else None
    if mode != "abort":
        raise BadRequest(
            f"pause_generation mode {mode!r} is not supported by the torch engine; use 'abort'."
        )


def parse_abort_request(body: Any) -> tuple[Any, bool]:
    """``/abort_request``: ``(rid, abort_all)``; one of them must be given."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    rid, abort_all = body.get("rid"), as_bool("abort_all", body.get("abort_all", False))
    if rid is None and not abort_all:
        raise BadRequest("Give rid or abort_all: true.")
    return rid, abort_all


@dataclass(frozen=True)
class UpdateWeightsRequest:
    """A ``/update_weights_from_disk`` body."""

    model_path: str
    weight_version: str | None
    abort_all_requests: bool


def parse_update_weights_request(body: Any) -> UpdateWeightsRequest:
    if (
        not isinstance(body, dict)
        or not isinstance(body.get("model_path"), str)
        or not body["model_path"]
    ):
        raise BadRequest("update_weights_from_disk needs model_path (a directory).")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, (str, int)):
        raise BadRequest("weight_version must be a string.")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        raise BadRequest(
            f"load_format {body['load_format']!r} is not supported by the torch engine."
        )
    return UpdateWeightsRequest(
        model_path=body["model_path"],
        weight_version=None if version is None else str(version),
        abort_all_requests=as_bool("abort_all_requests", body.get("abort_all_requests", False)),
    )


def parse_slow_down_request(body: Any) -> float | None:
    """``/slow_down``: seconds to sleep after each forward step, or None to stop."""
    value = body.get("forward_sleep_time") if isinstance(body, dict) else None
    return None if value is None else max(0.0, as_float("forward_sleep_time", value))


# --------------------------------------------------------------------------- LoRA adapters


def parse_load_lora_request(body: Any) -> tuple[str, str, bool]:
    """``/load_lora_adapter``: ``(lora_name, lora_path, pinned)``; a pinned one is never evicted."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise BadRequest("load_lora_adapter needs lora_name and lora_path (non-empty strings).")
    return name, path, as_bool("pinned", body.get("pinned", False))


def parse_unload_lora_request(body: Any) -> str:
    """``/unload_lora_adapter``: the ``lora_name``."""
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise BadRequest("unload_lora_adapter needs lora_name (a non-empty string).")
    return name
