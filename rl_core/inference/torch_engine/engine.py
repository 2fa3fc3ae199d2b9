"""The torch engine's model, running batch and scheduler thread (continuous batching).

A scheduler thread admits queued requests between decode steps, prefills the
new requests together (right-padded: prefill.py), then runs one batched decode
step for all running requests over a left-padded KV cache
(``kv_cache.PaddedBatchCache``). Model compute never runs on the HTTP event
loop: other threads talk to the engine through ``submit`` and ``call``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rl_core.inference.torch_engine.fair import FairQueue, TokenRates
from rl_core.inference.torch_engine.kv_cache import KV, PaddedBatchCache
from rl_core.inference.torch_engine.lora import AdapterSet
from rl_core.inference.torch_engine.penalties import apply_penalties, penalised
from rl_core.inference.torch_engine.prefill import (
    MAX_PREFILL_TOKENS,
    Prefilled,
    chunks,
    prefill,
    wants_input_logprobs,
)
from rl_core.inference.torch_engine.prefix_cache import (
    DEFAULT_MAX_MB,
    PrefixCache,
    prefill_continued,
)
from rl_core.inference.torch_engine.protocol import BadRequest, GenerateRequest, generate_response
from rl_core.inference.torch_engine.sample import sample_tokens
from rl_core.inference.torch_engine.weight_load import check_same_shapes, load_model
from rl_core.sampling import logprob_temperature

logger = logging.getLogger("rl_core.inference.torch_engine")


class EngineStopped(RuntimeError):
    """The engine is shutting down; answered with HTTP 503."""


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


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
        max_prefill_tokens: int = MAX_PREFILL_TOKENS,
        weight_version: str = "default",
        context_length: int | None = None,
        served_model_name: str | None = None,
        server_args: dict[str, Any] | None = None,
        adapters: AdapterSet | None = None,
        prefix_cache_mb: int = DEFAULT_MAX_MB,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = str(weight_version)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        max_positions: int = getattr(model.config, "max_position_embeddings", None) or 4096
        self.context_length = int(context_length or max_positions)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.server_args = dict(server_args or {})
        self.adapters = adapters  # LoRA adapters (--enable-lora), applied per row: lora.py
        self.device = next(model.parameters()).device
        layer_types = getattr(model.config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            # The left-padded batch cache assumes every layer keeps all past keys.
            raise ValueError(
                f"the torch engine serves full-attention models only; this one has layers {sorted(set(layer_types))}"
            )

        self._cond = threading.Condition()
        # Waiting requests per run, admitted by weighted fair share (fair.py); guarded by _cond.
        self._waiting = FairQueue(max_running_requests)
        self._commands: list[Callable[[], None]] = []  # guarded by _cond
        # Run only when no request is running; guarded by _cond.
        self._idle_commands: list[Callable[[], None]] = []
        self._paused = False  # guarded by _cond
        self._stopping = False
        self._in_flight: dict[str, GenerateRequest] = {}  # rid -> request; guarded by _cond
        self.forward_sleep_time: float | None = None

        # The running batch (scheduler thread only); row i of the cache is _running[i].
        self._running: list[GenerateRequest] = []
        self._cache = PaddedBatchCache(self.device)
        # Finished requests' KV for the next request with the same beginning (prefix_cache.py)
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb > 0 else None
        self.receiver: Any = None  # weight_update.WeightReceiver, made on the first group init

        self.stats = {
            "max_batch_size_seen": 0,
            "num_decode_steps": 0,
            "num_prefills": 0,  # prompts prefilled
            "num_prefill_batches": 0,  # forward passes they took (prefill.py batches them)
            "num_finished_reqs": 0,
            "num_aborted_reqs": 0,
            "num_generated_tokens": 0,
            "num_weight_updates": 0,
            "last_swap_seconds": 0.0,  # how long the last weight swap held the scheduler
            "busy_seconds": 0.0,  # wall time in scheduler steps (prefill + decode): utilisation
        }
        self.tokens_by_tenant: collections.Counter[str] = collections.Counter()  # generated
        self.token_rates = TokenRates()  # the same over the last seconds: tokens/s per run
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

    def submit(self, req: GenerateRequest) -> None:
        """Queue a request; a duplicate in-flight ``rid`` is refused (as SGLang does)."""
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if req.rid in self._in_flight:
                raise BadRequest(f"A request with rid {req.rid!r} is already in flight.")
            if req.lora_path is not None:
                if self.adapters is None:
                    raise BadRequest("lora_path needs a server started with --enable-lora.")
                req.adapter = self.adapters.acquire(req.lora_path)  # released by _finish
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
            depth, paused = self._waiting.depth(), self._paused
            weights = dict(self._waiting.weights)
        running = collections.Counter(r.tenant for r in list(self._running))
        rates = self.token_rates.per_second(time.monotonic())
        tenants = {
            tenant: {
                "running_reqs": running.get(tenant, 0),
                "waiting_reqs": depth.get(tenant, 0),
                "generated_tokens": self.tokens_by_tenant.get(tenant, 0),
                "tokens_per_s": rates.get(tenant, 0.0),
                "weight": weights.get(tenant, 1.0),
            }
            for tenant in sorted(set(running) | set(depth) | set(self.tokens_by_tenant))
        }
        if self.adapters is not None:
            adapters = {
                "loaded_adapters": sorted(self.adapters.loaded()),
                "evicted_adapters": self.adapters.evicted(),
                "num_adapter_evictions": self.adapters.evictions,
                "num_adapter_reloads": self.adapters.reloads,
            }
        else:
            adapters = {}
        cached = self.prefix_cache.stats() if self.prefix_cache is not None else {}
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": sum(depth.values()),
            **adapters,
            **cached,
            "paused": paused,
            "weight_version": self.weight_version,
            "tenants": tenants,  # per run (adapter name without its version): fair.py
            "fair_share_weights": weights,
            **self.stats,
        }

    def set_fair_share_weights(self, weights: dict[str, float]) -> None:
        """Each run's weight in the batch's fair share (fair.py); runs not named weigh 1."""
        with self._cond:
            self._waiting.set_weights(weights)

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
        self, rid: str | None = None, *, abort_all: bool = False, req: GenerateRequest | None = None
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

    def load_weights(self, model_path: str) -> Any:
        """Load a model from ``model_path`` like the served one, for ``swap_model``.

        Runs on any thread while the engine keeps serving; raises when the directory
        holds no model or one whose parameter shapes differ from the served model's.
        """
        new_model = load_model(model_path, dtype=self.model.dtype, device=self.device)
        check_same_shapes(self.model, new_model)
        return new_model

    def swap_model(self, model: Any, model_path: str, weight_version: str | None) -> float:
        """Install a new model between two steps; running requests go on with it. Seconds."""
        started = time.perf_counter()
        self.model = model
        self.model_path = model_path
        if self.adapters is not None:
            self.adapters.attach(model)
        self._updated(weight_version)
        return self._swapped(started)

    def install_weights(
        self,
        tensors: dict[str, torch.Tensor],
        weight_version: str | None,
        model_path: str | None = None,
    ) -> float:
        """Swap received tensors into the model between two steps (state-dict names). Seconds.

        A pointer swap (``param.data = staged``; the staging buffers become the model's,
        so the caller must not reuse them), copying only where dtype or device differ.
        Running requests keep their KV cache (computed by the old weights, as SGLang's
        in-place pause keeps it) and sample their next tokens from the new ones.
        """
        started = time.perf_counter()
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in tensors.items():
                target = named.get(name)
                if target is None:  # state-dict extra state: no tensor to point elsewhere
                    self.model.state_dict()[name].copy_(tensor)
                elif (target.dtype, target.device, target.shape) == (
                    tensor.dtype,
                    tensor.device,
                    tensor.shape,
                ):
                    target.data = tensor  # tied aliases share the Parameter: both follow
                else:
                    target.copy_(tensor)
        if model_path is not None:
            self.model_path = model_path
        self._updated(weight_version)
        return self._swapped(started)

    def _updated(self, weight_version: str | None) -> None:
        self.flush_prefix_cache()  # KV of the old weights
        if weight_version is not None:
            self.weight_version = str(weight_version)
        self.stats["num_weight_updates"] += 1

    def flush_prefix_cache(self, adapter: str | None = None, *, everything: bool = True) -> None:
        """Forget cached KV: all of it, or (``everything=False``) one adapter's."""
        if self.prefix_cache is None:
            return
        if everything:
            self.prefix_cache.clear()
        else:
            self.prefix_cache.forget(adapter)

    def _swapped(self, started: float) -> float:
        seconds = time.perf_counter() - started
        self.stats["last_swap_seconds"] = seconds
        return seconds

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
        self._running = []
        self._cache.clear()

    def _step(self) -> None:
        admitted: list[GenerateRequest] = []
        with self._cond:
            if not self._paused and not self._idle_commands:
                admitted = self._waiting.pick(self._running, self._fits)
        ready = [req for req in admitted if self._needs_prefill(req)]
        fresh = []
        for req in ready:
            hit = self._cached(req)
            if hit is None:
                fresh.append(req)
            else:
                self._prefill([req], past=hit)
        for group in chunks(fresh, self.max_prefill_tokens):
            self._prefill(group)
        if self._running:
            self._decode()
            if self.forward_sleep_time:
                time.sleep(self.forward_sleep_time)

    def _fits(self, req: GenerateRequest, admitted: list[GenerateRequest]) -> bool:
        """Whether ``req`` may join beside ``admitted``: SGLang's ``--max-loras-per-batch``."""
        if self.adapters is None:
            return True
        in_batch = [r.adapter for r in self._running] + [r.adapter for r in admitted]
        return self.adapters.fits(in_batch, req.adapter)

    def _needs_prefill(self, req: GenerateRequest) -> bool:
        """False when ``req`` is answered without a forward pass (and so finished here)."""
        if len(req.input_ids) >= self.context_length:  # the HTTP layer refuses these first
            self._finish(req, {"type": "abort", "message": "The input exceeds the context length."})
            return False
        if req.params.max_new_tokens == 0 and not wants_input_logprobs(req):
            self._finish(req, {"type": "length", "length": 0})
            return False
        return True

    def _cached(self, req: GenerateRequest) -> KV | None:
        """The cached KV of the longest prefix of ``req``'s prompt, if the cache holds one."""
        if self.prefix_cache is None:
            return None
        req.cache_epoch = self.prefix_cache.epoch
        if wants_input_logprobs(req):  # their logits are wanted: computed again
            return None
        hit = self.prefix_cache.match(req.lora_path, req.input_ids)
        if hit is None:
            return None
        req.cached_tokens, kv = hit
        return kv

    def _prefill(self, reqs: list[GenerateRequest], past: KV | None = None) -> None:
        """Run the prompts together, sample each first token, join the batch (prefill.py);
        with ``past``, one request's prompt after its cached prefix (prefix_cache.py)."""
        if self.adapters is not None:
            self.adapters.select([r.adapter for r in reqs])
        try:
            if past is None:
                done = prefill(self.model, reqs, self.device)
            else:
                done = prefill_continued(self.model, reqs[0], past, self.device)
        except Exception as exc:  # a bad prompt must not take the others down with it
            if past is not None:
                reqs[0].cached_tokens = 0
                self._prefill(reqs)
                return
            if len(reqs) > 1:
                for req in reqs:
                    self._prefill([req])
                return
            logger.exception("prefill of %s failed", reqs[0].rid)
            self._finish(reqs[0], {"type": "abort", "message": f"Engine error: {exc}"})
            return
        self.stats["num_prefills"] += len(reqs)
        self.stats["num_prefill_batches"] += 1
        try:
            self._start(reqs, done)
        except Exception as exc:  # none of them may be left waiting on a step that failed
            logger.exception("starting %d prefilled requests failed", len(reqs))
            for req in reqs:
                if req not in self._running:
                    self._finish(req, {"type": "abort", "message": f"Engine error: {exc}"})

    def _start(self, reqs: list[GenerateRequest], done: Prefilled) -> None:
        """Record what the prefill gave, sample each first token, join the batch."""
        tops = done.input_top or [None] * len(reqs)
        for req, logprobs, top in zip(reqs, done.input_logprobs, tops, strict=True):
            if logprobs is not None:
                req.input_logprobs, req.input_top = logprobs, top or []
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
        going = [i for i, req in enumerate(reqs) if req.finish is None]
        if going:
            self._advance([reqs[i] for i in going], done.last_logits[going])
        joining = [i for i in going if reqs[i].finish is None]
        if joining:
            self._cache.join(done.cache, done.lengths, joining)
            self._running.extend(reqs[i] for i in joining)
        self.stats["max_batch_size_seen"] = max(
            self.stats["max_batch_size_seen"], len(self._running)
        )

    def _decode(self) -> None:
        """One batched decode step: feed every running request its last sampled token."""
        batch = len(self._running)
        last = torch.tensor([[r.output_ids[-1]] for r in self._running], device=self.device)
        if self.adapters is not None:
            self.adapters.select([r.adapter for r in self._running])
        logits = self._cache.decode(self.model, last)  # [B, V]
        self.stats["num_decode_steps"] += 1
        self.stats["max_batch_size_seen"] = max(self.stats["max_batch_size_seen"], batch)
        self._advance(self._running, logits.float())
        self._compact()

    def _advance(self, reqs: list[GenerateRequest], logits: torch.Tensor) -> None:
        """Sample one token per request from ``logits`` [B, V] and check stop conditions."""
        logits = logits.cpu()  # sampling uses per-request CPU generators
        if any(penalised(r.params) for r in reqs):  # before temperature, as SGLang's penalizers
            logits = torch.stack(
                [apply_penalties(logits[i], r.output_ids, r.params) for i, r in enumerate(reqs)]
            )
        # The tempered distribution, as SGLang reports it and the trainer recomputes
        # (rl_core.sampling): log_softmax(logits / T); greedy requests at T = 1.
        temps = torch.tensor([[logprob_temperature(r.params.temperature)] for r in reqs])  # [B, 1]
        logprobs = torch.log_softmax(logits / temps, dim=-1)  # [B, V]
        tokens = sample_tokens(logits, reqs, self.eos_ids)
        picked = logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        self.token_rates.add(collections.Counter(r.tenant for r in reqs), time.monotonic())
        for i, req in enumerate(reqs):
            req.output_ids.append(tokens[i])
            req.output_logprobs.append(picked[i])
            req.output_versions.append(self.weight_version)
            if req.top_logprobs_num:
                top = logprobs[i].topk(req.top_logprobs_num)
                req.output_top.append(
                    list(zip(top.values.tolist(), top.indices.tolist(), strict=True))
                )
            self.stats["num_generated_tokens"] += 1
            self.tokens_by_tenant[req.tenant] += 1
            finish = self._check_finish(req)
            if finish is not None:
                self._finish(req, finish)
            elif req.stream:
                req.sink(self._response(req), False)

    def _check_finish(self, req: GenerateRequest) -> dict[str, Any] | None:
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

    def _finish(self, req: GenerateRequest, reason: dict[str, Any]) -> None:
        if req.finish is not None:
            return
        req.finish = reason
        with self._cond:
            self._in_flight.pop(req.rid, None)
        if req.adapter is not None:
            self.adapters.release(req.adapter)  # type: ignore[union-attr]
        self.stats["num_finished_reqs"] += 1
        if reason["type"] == "abort":
            self.stats["num_aborted_reqs"] += 1
        try:
            req.sink(self._response(req), True)
        except Exception:  # the client went away; nothing to deliver to
            logger.debug("could not deliver the result of %s", req.rid, exc_info=True)

    def _compact(self) -> None:
        """Drop finished requests from the batch (and their cache rows)."""
        keep = [i for i, r in enumerate(self._running) if r.finish is None]
        if len(keep) == len(self._running):
            return
        if self.prefix_cache is not None:
            finished = [i for i, r in enumerate(self._running) if r.finish is not None]
            self.prefix_cache.keep_rows(self._cache, self._running, finished)
        self._running = [self._running[i] for i in keep]
        self._cache.keep(keep)

    def _response(self, req: GenerateRequest) -> dict[str, Any]:
        return generate_response(req, tokenizer=self.tokenizer, weight_version=self.weight_version)
