"""The torch engine: SGLang's native HTTP API served by a plain transformers model.

CPU machines (laptops, CI) cannot run SGLang, so Steep ships this small engine
that speaks the same protocol; everything above it (the client, the gateway,
the rollout driver, weight sync) runs the code path it runs against SGLang.

    python -m rl_core.inference.torch_engine --model-path PATH --port 30000 \\
        [--host 127.0.0.1] [--max-running-requests 32] [--weight-version 0] \\
        [--num-threads N] [--dtype float32] [--device cpu] [--context-length N]

Endpoints (field names as SGLang's ``http_server.py`` / ``io_struct.py``):
``POST /generate`` (``input_ids`` or ``text``, ``sampling_params``, ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``, ``rid``,
``stream``), ``POST /pause_generation`` (``mode: "abort"``), ``POST /continue_generation``,
``POST /update_weights_from_disk`` (``model_path``, ``weight_version``,
``abort_all_requests``), ``POST /abort_request``, ``POST /slow_down``,
``GET|POST /flush_cache``, ``GET /health``, ``GET /health_generate``,
``GET /get_model_info`` = ``/model_info``, ``GET /get_server_info`` = ``/server_info``,
``GET /get_weight_version`` = ``/weight_version``, ``GET /v1/models``.

Semantics that RL relies on:

* ``meta_info.output_token_logprobs`` holds ``[logprob, token_id, text|None]`` per
  output token, where ``logprob`` is the log-softmax of the model's **raw logits**
  (temperature 1, before top-k/top-p/min-p) at that position: exactly what a trainer
  recomputes with a forward pass. (SGLang by default reports the log-prob after
  temperature scaling; Steep's SGLang launcher sets ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``
  so both backends agree.)
* ``meta_info.weight_version`` is the version of the weights that produced every
  token of the response: a weight update never lands in the middle of a request
  (it waits for running requests to finish, as SGLang's does, or aborts them).
* ``/pause_generation`` aborts every running and queued request; each returns
  ``finish_reason {"type": "abort"}`` with the tokens generated so far. Requests
  that arrive while paused wait until ``/continue_generation``.

Scheduling is continuous batching: a scheduler thread admits queued requests
between decode steps, prefills each new request on its own (no padding, so no
fully-masked rows), then runs one batched decode step for all running requests
over a left-padded KV cache. Model compute never runs on the HTTP event loop.
Targets full-attention decoder models (Llama, Qwen2/3, Mistral without sliding
window); models with sliding-window or recurrent layers are not supported.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

logger = logging.getLogger("rl_core.inference.torch_engine")

ENGINE_VERSION = "steep-torch-engine/0.1"
_SAMPLING_EPS = 1e-6  # temperatures below this are greedy, as in SGLang
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BadRequest(ValueError):
    """A request the engine refuses; answered with HTTP 400 and SGLang's error JSON."""


class EngineStopped(RuntimeError):
    """The engine is shutting down; answered with HTTP 503."""


# --------------------------------------------------------------------------- requests


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
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


# Accepted only when equal to these neutral values.
_NEUTRAL_PARAMS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
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


def _as_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}.")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}.")
    return value


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}.")
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
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
                p.max_new_tokens = _as_int(key, value, minimum=0)
        elif key == "min_new_tokens":
            p.min_new_tokens = _as_int(key, value, minimum=0)
        elif key == "temperature":
            p.temperature = _as_float(key, value)
            if p.temperature < 0:
                raise BadRequest(f"temperature must be >= 0, got {value}.")
        elif key == "top_p":
            p.top_p = _as_float(key, value)
            if not 0.0 < p.top_p <= 1.0:
                raise BadRequest(f"top_p must be in (0, 1], got {value}.")
        elif key == "top_k":
            p.top_k = _as_int(key, value, minimum=-1)
        elif key == "min_p":
            p.min_p = _as_float(key, value)
            if not 0.0 <= p.min_p <= 1.0:
                raise BadRequest(f"min_p must be in [0, 1], got {value}.")
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
            p.stop_token_ids = [_as_int("stop_token_ids[]", t, minimum=0) for t in ids]
            if any(t >= vocab_size for t in p.stop_token_ids):
                raise BadRequest(f"stop_token_ids must be < vocab size {vocab_size}.")
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            setattr(p, key, _as_bool(key, value))
        elif key == "sampling_seed":
            p.sampling_seed = None if value is None else _as_int(key, value)
        else:
            raise BadRequest(f"Unknown sampling parameter {key!r}.")
    if p.min_new_tokens > p.max_new_tokens:
        raise BadRequest("min_new_tokens must be <= max_new_tokens.")
    return p


class _Request:
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
    ):
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.return_text_in_logprobs = return_text_in_logprobs
        self.stream = stream
        self.created = time.monotonic()
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[tuple[float | None, int]] = []
        self.finish: dict[str, Any] | None = None
        seed = params.sampling_seed if params.sampling_seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        # Called from the scheduler thread with (payload, final); set by the HTTP handler.
        self.sink: Callable[[dict[str, Any], bool], None] = lambda payload, final: None


def parse_generate_request(body: Any, *, tokenizer: Any, vocab_size: int) -> _Request:
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
        _as_int("input_ids[]", t, minimum=0)
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
        else _as_int("logprob_start_len", logprob_start_len, minimum=-1)
    )
    top_n = body.get("top_logprobs_num")
    top_n = 0 if top_n is None else _as_int("top_logprobs_num", top_n, minimum=0)
    if top_n > vocab_size:
        raise BadRequest(f"top_logprobs_num must be <= vocab size {vocab_size}.")
    return _Request(
        rid=rid,
        input_ids=list(input_ids),
        params=parse_sampling_params(body.get("sampling_params"), vocab_size),
        return_logprob=_as_bool("return_logprob", body.get("return_logprob") or False),
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_n,
        return_text_in_logprobs=_as_bool(
            "return_text_in_logprobs", body.get("return_text_in_logprobs") or False
        ),
        stream=_as_bool("stream", body.get("stream") or False),
    )


# --------------------------------------------------------------------------- engine


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of a transformers DynamicCache, each ``[B, H_kv, T, D]``."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # older transformers


def _make_cache(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(tensors)


class TorchEngine:
    """The model, its running batch and the scheduler thread behind the HTTP API.

    Other threads talk to it only through ``submit``, ``call`` and a few lock-guarded
    flags; everything else (the batch, the KV cache, request progress) belongs to the
    scheduler thread.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_path: str,
        max_running_requests: int = 32,
        weight_version: str = "default",
        context_length: int | None = None,
        served_model_name: str | None = None,
        server_args: dict[str, Any] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.max_running_requests = max_running_requests
        self.weight_version = str(weight_version)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        max_positions: int = getattr(model.config, "max_position_embeddings", None) or 4096
        self.context_length = int(context_length or max_positions)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.server_args = dict(server_args or {})
        self.device = next(model.parameters()).device
        layer_types = getattr(model.config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            # The left-padded batch cache assumes every layer keeps all past keys.
            raise ValueError(
                f"the torch engine serves full-attention models only; this one has layers {sorted(set(layer_types))}"
            )

        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()  # guarded by _cond
        self._commands: list[Callable[[], None]] = []  # guarded by _cond
        # Run only when no request is running; guarded by _cond.
        self._idle_commands: list[Callable[[], None]] = []
        self._paused = False  # guarded by _cond
        self._stopping = False
        self._in_flight: dict[str, _Request] = {}  # rid -> request; guarded by _cond
        self.forward_sleep_time: float | None = None

        # The running batch (scheduler thread only). Row i of the KV cache belongs to
        # _running[i]; _mask marks real (1) vs left-padding (0) cache positions.
        self._running: list[_Request] = []
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._mask: torch.Tensor | None = None  # [B, T] long

        self.stats = {
            "max_batch_size_seen": 0,
            "num_decode_steps": 0,
            "num_prefills": 0,
            "num_finished_reqs": 0,
            "num_aborted_reqs": 0,
            "num_generated_tokens": 0,
            "num_weight_updates": 0,
            "busy_seconds": 0.0,  # wall time in scheduler steps (prefill + decode): utilisation
        }
        self._thread = threading.Thread(
            target=self._run, name="torch-engine-scheduler", daemon=True
        )

    # ----- interface for other threads

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def stop(self) -> None:
        """Abort everything and end the scheduler thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, req: _Request) -> None:
        """Queue a request; a duplicate in-flight ``rid`` is refused (as SGLang does)."""
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if req.rid in self._in_flight:
                raise BadRequest(f"A request with rid {req.rid!r} is already in flight.")
            self._in_flight[req.rid] = req
            self._waiting.append(req)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any], *, when_idle: bool = False) -> asyncio.Future[Any]:
        """Run ``fn`` on the scheduler thread between steps; await the returned future.

        ``when_idle`` waits until no request is running and admits none meanwhile: how a
        weight update waits for in-flight requests, like SGLang's model-update lock.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(setter: Callable[[Any], None], value: Any) -> None:
            if not fut.done():
                setter(value)

        def command() -> None:
            try:
                result = fn()
            except BaseException as exc:  # delivered to the awaiting handler
                loop.call_soon_threadsafe(settle, fut.set_exception, exc)
            else:
                loop.call_soon_threadsafe(settle, fut.set_result, result)

        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            (self._idle_commands if when_idle else self._commands).append(command)
            self._cond.notify_all()
        return fut

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            waiting, paused = len(self._waiting), self._paused
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": waiting,
            "paused": paused,
            "weight_version": self.weight_version,
            **self.stats,
        }

    # ----- commands (run on the scheduler thread)

    def pause(self) -> int:
        """Abort every running and queued request and hold new ones; return how many were aborted."""
        with self._cond:
            self._paused = True
            queued = list(self._waiting)
            self._waiting.clear()
        victims = self._running + queued
        for req in victims:
            self._finish(req, {"type": "abort", "message": "Aborted by pause_generation."})
        self._compact()
        return len(victims)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort(
        self, rid: str | None = None, *, abort_all: bool = False, req: _Request | None = None
    ) -> int:
        """Abort one request (by rid or object) or all of them; return how many."""
        with self._cond:
            queued = list(self._waiting)
        targets = [
            r
            for r in self._running + queued
            if abort_all or (req is not None and r is req) or (rid is not None and r.rid == rid)
        ]
        with self._cond:
            for r in targets:
                if r in self._waiting:
                    self._waiting.remove(r)
        for r in targets:
            self._finish(r, {"type": "abort", "message": "Aborted by request."})
        self._compact()
        return len(targets)

    def swap_model(self, model: Any, model_path: str, weight_version: str | None) -> None:
        """Install new weights; only called when no request is running."""
        assert not self._running, "weights must not change under a running request"
        self.model = model
        self.model_path = model_path
        if weight_version is not None:
            self.weight_version = str(weight_version)
        self.stats["num_weight_updates"] += 1

    # ----- scheduler thread

    def _has_work(self) -> bool:
        admissible = bool(self._waiting) and not self._paused and not self._idle_commands
        return bool(
            self._stopping
            or self._commands
            or self._running
            or admissible
            or (self._idle_commands and not self._running)
        )

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._has_work():
                    self._cond.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            for command in commands:
                command()
            with self._cond:
                if self._idle_commands and not self._running:
                    commands, self._idle_commands = self._idle_commands, []
                else:
                    commands = []
            for command in commands:
                command()
            started = time.perf_counter()
            try:
                self._step()
            except Exception as exc:  # never let one bad step kill the server
                logger.exception("scheduler step failed; aborting the running batch")
                for req in self._running:
                    self._finish(req, {"type": "abort", "message": f"Engine error: {exc}"})
                self._compact()
            self.stats["busy_seconds"] += time.perf_counter() - started
        # Shutting down: nobody waits forever.
        with self._cond:
            queued = list(self._waiting)
            self._waiting.clear()
        for req in self._running + queued:
            self._finish(req, {"type": "abort", "message": "The server is shutting down."})
        self._running, self._kv, self._mask = [], None, None

    def _step(self) -> None:
        admitted: list[_Request] = []
        with self._cond:
            if not self._paused and not self._idle_commands:
                while (
                    self._waiting and len(self._running) + len(admitted) < self.max_running_requests
                ):
                    admitted.append(self._waiting.popleft())
        for req in admitted:
            try:
                self._prefill(req)
            except Exception as exc:  # a bad prompt must not take the batch down with it
                logger.exception("prefill of %s failed", req.rid)
                self._finish(req, {"type": "abort", "message": f"Engine error: {exc}"})
        if self._running:
            self._decode()
            if self.forward_sleep_time:
                time.sleep(self.forward_sleep_time)

    def _prefill(self, req: _Request) -> None:
        """Run the prompt alone (no padding), sample the first token, join the batch."""
        if len(req.input_ids) >= self.context_length:  # the HTTP layer refuses these first
            self._finish(req, {"type": "abort", "message": "The input exceeds the context length."})
            return
        want_input = 0 <= req.logprob_start_len < len(req.input_ids)
        if req.params.max_new_tokens == 0 and not want_input:
            self._finish(req, {"type": "length", "length": 0})
            return
        ids = torch.tensor([req.input_ids], device=self.device)  # [1, L]
        out = self.model(
            input_ids=ids,
            position_ids=torch.arange(ids.shape[1], device=self.device)[None],
            past_key_values=_make_cache([]),
            use_cache=True,
            logits_to_keep=0 if want_input else 1,
        )
        self.stats["num_prefills"] += 1
        logits = out.logits[0].float()  # [L or 1, V]
        if want_input:
            logprobs = torch.log_softmax(logits[:-1], dim=-1)  # row i predicts token i + 1
            start = req.logprob_start_len
            targets = torch.tensor(req.input_ids[1:], device=logits.device)
            picked = logprobs.gather(-1, targets[:, None])[:, 0].tolist()
            req.input_logprobs = [
                (None if i == 0 else picked[i - 1], req.input_ids[i])
                for i in range(start, len(req.input_ids))
            ]
        if req.params.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        self._advance([req], logits[-1:])
        if req.finish is None:
            self._join_batch(_cache_tensors(out.past_key_values), len(req.input_ids))
            self._running.append(req)
        self.stats["max_batch_size_seen"] = max(
            self.stats["max_batch_size_seen"], len(self._running)
        )

    def _join_batch(self, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        mask = torch.ones(1, length, dtype=torch.long, device=self.device)
        if self._kv is None or self._mask is None:
            self._kv, self._mask = kv, mask
            return
        t_old, t_new = self._mask.shape[1], length
        t = max(t_old, t_new)

        def left_pad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
            if n == 0:
                return x
            shape = list(x.shape)
            shape[dim] = n
            return torch.cat([x.new_zeros(shape), x], dim=dim)

        self._kv = [
            (
                torch.cat([left_pad(k0, t - t_old, 2), left_pad(k1, t - t_new, 2)]),
                torch.cat([left_pad(v0, t - t_old, 2), left_pad(v1, t - t_new, 2)]),
            )
            for (k0, v0), (k1, v1) in zip(self._kv, kv, strict=True)
        ]
        self._mask = torch.cat([left_pad(self._mask, t - t_old, 1), left_pad(mask, t - t_new, 1)])

    def _decode(self) -> None:
        """One batched decode step: feed every running request its last sampled token."""
        assert self._kv is not None and self._mask is not None
        batch = len(self._running)
        last = torch.tensor([[r.output_ids[-1]] for r in self._running], device=self.device)
        # Padded cache positions are masked out; each row's RoPE position is its own
        # count of real tokens, so left padding changes nothing numerically.
        attention_mask = torch.cat([self._mask, self._mask.new_ones(batch, 1)], dim=1)  # [B, T+1]
        position_ids = self._mask.sum(dim=1, keepdim=True)  # [B, 1]
        out = self.model(
            input_ids=last,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=_make_cache(self._kv),
            use_cache=True,
        )
        self._kv = _cache_tensors(out.past_key_values)
        self._mask = attention_mask
        self.stats["num_decode_steps"] += 1
        self.stats["max_batch_size_seen"] = max(self.stats["max_batch_size_seen"], batch)
        self._advance(self._running, out.logits[:, -1, :].float())
        self._compact()

    def _advance(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per request from ``logits`` [B, V] and check stop conditions."""
        logits = logits.cpu()  # sampling uses per-request CPU generators
        # Raw logits, temperature 1: the quantity the trainer recomputes.
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, req in enumerate(reqs):
            token = self._sample(logits[i], req)
            req.output_ids.append(token)
            req.output_logprobs.append(float(logprobs[i, token]))
            if req.top_logprobs_num:
                top = logprobs[i].topk(req.top_logprobs_num)
                req.output_top.append(
                    list(zip(top.values.tolist(), top.indices.tolist(), strict=True))
                )
            self.stats["num_generated_tokens"] += 1
            finish = self._check_finish(req)
            if finish is not None:
                self._finish(req, finish)
            elif req.stream:
                req.sink(self._response(req), False)

    def _sample(self, logits: torch.Tensor, req: _Request) -> int:
        p = req.params
        if len(req.output_ids) < p.min_new_tokens and not p.ignore_eos:
            logits = logits.clone()
            logits[list(self.eos_ids | set(p.stop_token_ids))] = float("-inf")
        if p.temperature < _SAMPLING_EPS:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            outside = (
                torch.cumsum(sorted_probs, dim=-1) - sorted_probs > p.top_p
            )  # keep the smallest nucleus
            probs = torch.zeros_like(probs).scatter(
                0, order, sorted_probs.masked_fill(outside, 0.0)
            )
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def _check_finish(self, req: _Request) -> dict[str, Any] | None:
        p, token, n = req.params, req.output_ids[-1], len(req.output_ids)
        if not p.ignore_eos and (token in self.eos_ids or token in p.stop_token_ids):
            return {"type": "stop", "matched": token}
        if p.stop:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if n >= p.max_new_tokens or len(req.input_ids) + n >= self.context_length:
            return {"type": "length", "length": n}
        return None

    def _finish(self, req: _Request, reason: dict[str, Any]) -> None:
        if req.finish is not None:
            return
        req.finish = reason
        with self._cond:
            self._in_flight.pop(req.rid, None)
        self.stats["num_finished_reqs"] += 1
        if reason["type"] == "abort":
            self.stats["num_aborted_reqs"] += 1
        try:
            req.sink(self._response(req), True)
        except Exception:  # the client went away; nothing to deliver to
            logger.debug("could not deliver the result of %s", req.rid, exc_info=True)

    def _compact(self) -> None:
        """Drop finished rows from the batch and any left padding no row needs."""
        keep = [i for i, r in enumerate(self._running) if r.finish is None]
        if len(keep) == len(self._running):
            return
        self._running = [self._running[i] for i in keep]
        if not keep or self._kv is None or self._mask is None:
            self._running, self._kv, self._mask = [], None, None
            return
        index = torch.tensor(keep, device=self.device)
        mask = self._mask.index_select(0, index)
        first = int(mask.any(dim=0).nonzero()[0])
        self._mask = mask[:, first:]
        self._kv = [
            (k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:])
            for k, v in self._kv
        ]

    def _response(self, req: _Request) -> dict[str, Any]:
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
        text = self.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
        if finish and isinstance(finish.get("matched"), str) and not p.no_stop_trim:
            text = text[: text.find(finish["matched"])] if finish["matched"] in text else text
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - req.created,
        }
        if req.return_logprob:

            def piece(token: int) -> str | None:
                return self.tokenizer.decode([token]) if req.return_text_in_logprobs else None

            meta["output_token_logprobs"] = [
                [lp, t, piece(t)] for lp, t in zip(req.output_logprobs, req.output_ids, strict=True)
            ]
            meta["input_token_logprobs"] = [[lp, t, piece(t)] for lp, t in req.input_logprobs]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [[lp, t, piece(t)] for lp, t in row] for row in req.output_top
                ]
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


# --------------------------------------------------------------------------- HTTP


def _error(status: int, message: str) -> web.Response:
    # SGLang's ErrorResponse shape (http_server.py validation handler).
    phrase = {
        400: "Bad Request",
        404: "Not Found",
        405: "Method Not Allowed",
        503: "Service Unavailable",
    }
    body = {
        "object": "error",
        "message": message,
        "type": phrase.get(status, "Internal Server Error"),
        "param": None,
        "code": status,
    }
    return web.json_response(body, status=status)


@web.middleware
async def _errors_as_json(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, str(exc))
    except EngineStopped as exc:
        return _error(503, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, f"Internal error: {exc}")


async def _json_body(request: web.Request, *, default: Any = None) -> Any:
    raw = await request.read()
    if not raw.strip():
        if default is not None:
            return default
        raise BadRequest("The request body must be JSON.")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from None


def build_app(engine: TorchEngine) -> web.Application:
    """The aiohttp application serving SGLang's native endpoints for ``engine``."""
    routes = web.RouteTableDef()

    @routes.get("/health")
    @routes.get("/health_generate")
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if engine.is_alive() else 503)

    @routes.post("/generate")
    @routes.put("/generate")
    async def generate(request: web.Request) -> web.StreamResponse:
        req = parse_generate_request(
            await _json_body(request), tokenizer=engine.tokenizer, vocab_size=engine.vocab_size
        )
        if len(req.input_ids) >= engine.context_length:
            raise BadRequest(
                f"The input ({len(req.input_ids)} tokens) is longer than the model's context length ({engine.context_length} tokens)."
            )
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[tuple[dict[str, Any], bool]] = asyncio.Queue()

        def sink(payload: dict[str, Any], final: bool) -> None:
            try:
                loop.call_soon_threadsafe(updates.put_nowait, (payload, final))
            except RuntimeError:  # the loop is closed: the server is going away
                pass

        req.sink = sink
        engine.submit(req)
        try:
            if not req.stream:
                while True:
                    payload, final = await updates.get()
                    if final:
                        return web.json_response(payload)
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            while True:
                payload, final = await updates.get()
                await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                if final:
                    break
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: stop spending compute on its request.
            if req.finish is None:
                with contextlib.suppress(EngineStopped):
                    engine.call(lambda: engine.abort(req=req)).add_done_callback(
                        lambda f: f.cancelled() or f.exception()
                    )
            raise

    @routes.post("/pause_generation")
    async def pause_generation(request: web.Request) -> web.Response:
        body = await _json_body(request, default={})
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode != "abort":
            raise BadRequest(
                f"pause_generation mode {mode!r} is not supported by the torch engine; use 'abort'."
            )
        await engine.call(engine.pause)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @routes.post("/continue_generation")
    async def continue_generation(request: web.Request) -> web.Response:
        await engine.call(engine.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @routes.post("/abort_request")
    async def abort_request(request: web.Request) -> web.Response:
        body = await _json_body(request, default={})
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        rid, abort_all = body.get("rid"), _as_bool("abort_all", body.get("abort_all", False))
        if rid is None and not abort_all:
            raise BadRequest("Give rid or abort_all: true.")
        await engine.call(lambda: engine.abort(rid, abort_all=abort_all))
        return web.Response(status=200)

    @routes.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("model_path"), str)
            or not body["model_path"]
        ):
            raise BadRequest("update_weights_from_disk needs model_path (a directory).")
        model_path = body["model_path"]
        version = body.get("weight_version")
        if version is not None and not isinstance(version, (str, int)):
            raise BadRequest("weight_version must be a string.")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(
                f"load_format {body['load_format']!r} is not supported by the torch engine."
            )
        abort_all = _as_bool("abort_all_requests", body.get("abort_all_requests", False))
        try:
            # Load while still serving; only the swap waits for running requests.
            new_model = await asyncio.to_thread(
                load_model, model_path, dtype=engine.model.dtype, device=engine.device
            )
            _check_same_shapes(engine.model, new_model)
        except Exception as exc:
            message = f"Failed to update weights from {model_path}: {exc}"
            logger.warning(message)
            return web.json_response(
                {"success": False, "message": message, "num_paused_requests": 0}, status=400
            )
        if abort_all:
            await engine.call(lambda: engine.abort(abort_all=True))
        await engine.call(
            lambda: engine.swap_model(
                new_model, model_path, None if version is None else str(version)
            ),
            when_idle=True,
        )
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    @routes.post("/slow_down")
    async def slow_down(request: web.Request) -> web.Response:
        body = await _json_body(request)
        value = body.get("forward_sleep_time") if isinstance(body, dict) else None
        engine.forward_sleep_time = (
            None if value is None else max(0.0, _as_float("forward_sleep_time", value))
        )
        return web.json_response({})

    @routes.get("/flush_cache")
    @routes.post("/flush_cache")
    async def flush_cache(request: web.Request) -> web.Response:
        # There is no prefix cache to flush; mirror SGLang's refusal while requests run.
        state = engine.snapshot()
        if state["num_running_reqs"] or state["num_waiting_reqs"]:
            return web.Response(
                status=400, text="Cache not flushed: there are running or waiting requests.\n"
            )
        return web.Response(status=200, text="Cache flushed.\n")

    def model_info() -> dict[str, Any]:
        config = engine.model.config
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.server_args.get("tokenizer_path", engine.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    @routes.get("/get_model_info")
    @routes.get("/model_info")
    async def get_model_info(request: web.Request) -> web.Response:
        return web.json_response(model_info())

    @routes.get("/get_weight_version")
    @routes.get("/weight_version")
    async def get_weight_version(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": engine.weight_version})

    @routes.get("/get_server_info")
    @routes.get("/server_info")
    async def get_server_info(request: web.Request) -> web.Response:
        info = {
            **engine.server_args,
            "model_path": engine.model_path,
            "weight_version": engine.weight_version,
            "max_running_requests": engine.max_running_requests,
            "context_length": engine.context_length,
            "internal_states": [engine.snapshot()],
            "version": ENGINE_VERSION,
        }
        return web.json_response(info)

    @routes.get("/v1/models")
    async def list_models(request: web.Request) -> web.Response:
        card = {
            "id": engine.served_model_name,
            "object": "model",
            "owned_by": "steep",
            "root": engine.served_model_name,
            "max_model_len": engine.context_length,
        }
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application(middlewares=[_errors_as_json], client_max_size=64 * 1024 * 1024)
    app.add_routes(routes)

    async def on_shutdown(app: web.Application) -> None:
        await asyncio.to_thread(engine.stop)

    app.on_shutdown.append(on_shutdown)
    return app


# --------------------------------------------------------------------------- startup


def load_model(
    path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Any:
    """Load a causal LM from a local directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def _check_same_shapes(old: Any, new: Any) -> None:
    old_shapes = {k: tuple(v.shape) for k, v in old.state_dict().items()}
    new_shapes = {k: tuple(v.shape) for k, v in new.state_dict().items()}
    if old_shapes != new_shapes:
        diff = sorted(set(old_shapes.items()) ^ set(new_shapes.items()))[:3]
        raise ValueError(
            f"the new weights do not match the served model's architecture (e.g. {diff})"
        )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rl_core.inference.torch_engine",
        description="Serve a causal LM over SGLang's native HTTP API with plain PyTorch.",
    )
    parser.add_argument(
        "--model-path", required=True, help="Local directory with the model and tokenizer."
    )
    parser.add_argument(
        "--tokenizer-path", default=None, help="Tokenizer directory (default: --model-path)."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--max-running-requests", type=int, default=32, help="Largest decode batch."
    )
    parser.add_argument(
        "--weight-version", default="default", help="Reported as meta_info.weight_version."
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="Default: the model's max_position_embeddings.",
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", choices=["auto", *_DTYPES], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=int(os.environ.get("STEEP_TORCH_THREADS", "0")) or None,
        help="torch intra-op threads (default: $STEEP_TORCH_THREADS, else torch's default).",
    )
    parser.add_argument(
        "--random-seed", type=int, default=None, help="Seed for requests without sampling_seed."
    )
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.random_seed is not None:
        random.seed(args.random_seed)
    from transformers import AutoTokenizer

    dtype = torch.float32 if args.dtype in ("auto", "float32") else _DTYPES[args.dtype]
    model = load_model(args.model_path, dtype=dtype, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    server_args = {k: v for k, v in vars(args).items() if k != "log_level"}
    server_args["tokenizer_path"] = args.tokenizer_path or args.model_path
    engine = TorchEngine(
        model,
        tokenizer,
        model_path=args.model_path,
        max_running_requests=args.max_running_requests,
        weight_version=args.weight_version,
        context_length=args.context_length,
        served_model_name=args.served_model_name,
        server_args=server_args,
    )
    engine.start()
    logger.info(
        "serving %s (weight version %s) on http://%s:%d",
        args.model_path,
        engine.weight_version,
        args.host,
        args.port,
    )
    web.run_app(
        build_app(engine),
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
