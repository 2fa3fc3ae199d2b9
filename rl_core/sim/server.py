"""An inference server stand-in: SGLang's HTTP protocol, GPU time from a cost model, no GPU.

``SimServer`` is an ASGI app that answers the subset of SGLang's native API Steep's loop
uses (the same subset the torch engine implements): ``POST /generate`` (not streaming:
the rollout driver does not stream), ``/pause_generation`` (``in_place``/``retract`` hold
the batch, ``abort`` ends it), ``/continue_generation``, ``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/load_lora_adapter``, ``/unload_lora_adapter``,
``/abort_request``, ``/server_info``, ``/model_info``, ``/health``. It reports itself as SGLang on a GPU
(``version`` not the torch engine's), so ``rl_core.weight_sync`` takes its SGLang path:
pause in place, update, continue.

Its engine is a continuous-batching scheduler that sleeps what ``EngineCost`` says instead
of computing: new requests join the running batch between decode steps (prefill charged
per prompt token), each step costs ``step_seconds(B, K)``, and every output token carries
the weight version of the step that produced it (``meta_info.weight_versions`` spans).
Between two events (an arrival, a finish, a pause) the batch does not change, so the
engine sleeps through all the steps up to the next finish at once and is woken at a step
boundary when something arrives: the cost of a simulation grows with the number of
requests, not of tokens. Run it under ``rl_core.sim.clock.SimEventLoop`` and the sleeps
are simulated time.

What a request generates: ``lengths(seed)`` real tokens (seed: ``sampling_seed``; the
answer's length is the model's business, as with a real engine), cut at
``max_new_tokens``. ``tokens_per_id`` (the granularity) lets one output id stand for
several real tokens, so a 30k-token answer is a few thousand ids on the wire; the cost
model and all accounting use real tokens (ids x granularity). An aborted answer resumed
under the same ``rid`` (the client's resume loop) goes on where it stopped: its length
counts what the earlier segments generated, and its prefill is the whole context again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from rl_core.sim.cost import EngineCost, TrainerCost

LOGPROB = -0.6931  # every simulated token: log(1/2); the trainer stand-in never looks
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class _Request:
    rid: str
    prompt_ids: int
    target_ids: int  # ids to generate in all
    hit_limit: bool  # the target is max_new_tokens (finish "length")
    lora: str | None
    done: int = 0
    prior: int = 0  # ids its rid's earlier, aborted segments generated
    stop_asked: bool = False  # /abort_request: ends at the step under way
    spans: list[list[int]] = field(default_factory=list)  # [version, start]
    finished: asyncio.Future | None = None
    aborted: bool = False


@dataclass
class ServerStats:
    """What one stand-in did, in simulated seconds and real tokens."""

    busy_s: float = 0.0  # decoding or prefilling
    paused_s: float = 0.0  # held by pause_generation with requests waiting
    tokens: int = 0  # output tokens generated
    requests: int = 0
    max_running: int = 0
    batch_s: float = 0.0  # running requests x seconds decoding: / busy_s = the mean batch


class SimServer:
    """One simulated SGLang server (see the module docstring)."""

    def __init__(
        self,
        cost: EngineCost,
        sync_cost: TrainerCost,
        lengths: Callable[[int], int],
        *,
        tokens_per_id: int = 1,
        weight_version: int = 0,
    ):
        self.cost, self.sync_cost, self.lengths = cost, sync_cost, lengths
        self.g = max(1, int(tokens_per_id))
        self.version = weight_version
        self.stats = ServerStats()
        self.adapters: dict[str, str] = {}
        self._pending: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._paused = False
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None  # set while the engine is not in a step
        self._engine: asyncio.Task | None = None
        self._paused_since: float | None = None
        self._carried: dict[str, int] = {}  # rid -> ids generated before it was aborted

    @property
    def decoding(self) -> int:
        """Requests in the running batch now."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests received and not yet in the batch."""
        return len(self._pending)

    # ----- ASGI

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = orjson.loads(body) if body else {}
        status, answer = await self._route(scope["method"], scope["path"], data)
        payload = orjson.dumps(answer)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _route(self, method: str, path: str, data: dict) -> tuple[int, Any]:
        ok = {"success": True, "message": ""}
        if path in ("/health", "/health_generate"):
            return 200, {}
        if path in ("/server_info", "/get_server_info"):
            return 200, {"version": "sim-sglang", "device": "cuda", "tp_size": 1}
        if path in ("/model_info", "/get_model_info"):
            return 200, {"model_path": self.cost.name, "weight_version": str(self.version)}
        if path == "/generate":
            return await self._generate(data)
        if path == "/pause_generation":
            self._pause(str(data.get("mode", "abort")))
            if self._idle is not None:  # as SGLang: answered once the step under way ended
                await self._idle.wait()
            return 200, ok
        if path == "/continue_generation":
            self._set_paused(False)
            return 200, ok
        if path in ("/init_weights_update_group", "/destroy_weights_update_group"):
            return 200, ok
        if path == "/update_weights_from_distributed":
            nbytes = sum(
                _DTYPE_BYTES.get(str(dtype), 2) * _numel(shape)
                for dtype, shape in zip(data["dtypes"], data["shapes"], strict=True)
            )
            await asyncio.sleep(nbytes / self.sync_cost.broadcast_Bps)
            self._new_version(data.get("weight_version"))
            return 200, ok
        if path == "/update_weights_from_disk":
            await asyncio.sleep(self.sync_cost.weight_bytes() / self.sync_cost.disk_read_Bps)
            self._new_version(data.get("weight_version"))
            return 200, ok
        if path == "/load_lora_adapter":
            await asyncio.sleep(self.sync_cost.adapter_bytes() / self.sync_cost.disk_read_Bps)
            self.adapters[str(data["lora_name"])] = str(data["lora_path"])
            return 200, self._lora_answer()
        if path == "/abort_request":
            self._abort(data.get("rid"), abort_all=bool(data.get("abort_all")))
            return 200, {}
        if path == "/unload_lora_adapter":
            name = str(data["lora_name"])
            self.adapters.pop(name, None)
            return 200, self._lora_answer()
        return 404, {"error": {"message": f"{method} {path} is not simulated"}}

    def _lora_answer(self) -> dict[str, Any]:
        return {"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)}

    # ----- control

    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _set_paused(self, paused: bool) -> None:
        now = self._loop_time()
        if paused and not self._paused:
            self._paused_since = now
        elif not paused and self._paused and self._paused_since is not None:
            if self._running or self._pending:
                self.stats.paused_s += now - self._paused_since
            self._paused_since = None
        self._paused = paused
        self._poke()

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            for request in [*self._running, *self._pending]:
                self._end_aborted(request)
            self._running, self._pending = [], collections.deque()
        self._set_paused(True)

    def _abort(self, rid: Any, *, abort_all: bool) -> None:
        """SGLang's ``/abort_request``: a queued request ends now, a running one at the end of
        the step under way (with what it generated)."""
        for request in [r for r in self._pending if abort_all or r.rid == rid]:
            self._end_aborted(request)
            self._pending.remove(request)
        running = [r for r in self._running if abort_all or r.rid == rid]
        for request in running:
            if self._paused or self._idle is None or self._idle.is_set():  # between steps
                self._end_aborted(request)
            else:
                request.stop_asked = True
        if running:
            self._running = [r for r in self._running if not r.aborted]
            self._poke()

    def _new_version(self, value: Any) -> None:
        version = int(value) if value is not None else self.version + 1
        self.version = version
        for request in self._running:  # tokens from the next step on are the new version's
            if request.spans[-1][0] != version:
                request.spans.append([version, request.done])

    # ----- generation

    async def _generate(self, data: dict) -> tuple[int, Any]:
        if data.get("stream"):
            return 400, {"error": {"message": "streaming is not simulated"}}
        lora = data.get("lora_path")
        if lora is not None and lora not in self.adapters:
            return 400, {"error": {"message": f"LoRA adapter {lora!r} is not loaded"}}
        params = data.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        input_ids = data.get("input_ids") or []
        seed = params.get("sampling_seed")
        if seed is None:
            seed = int.from_bytes(
                hashlib.blake2b(str(data.get("rid")).encode(), digest_size=7).digest()
            )
        wanted = -(-max(1, int(self.lengths(int(seed)))) // self.g)  # ids, rounded up
        rid = str(data.get("rid") or "")
        prior = self._carried.pop(rid, 0) if rid else 0
        wanted -= prior  # a resumed answer goes on where it stopped
        request = _Request(
            rid=rid,
            prior=prior,
            prompt_ids=len(input_ids),
            target_ids=min(wanted, max_new),
            hit_limit=wanted >= max_new,
            lora=lora,
            finished=asyncio.get_running_loop().create_future(),
        )
        if request.target_ids <= 0:
            return 200, self._answer(request)
        self._ensure_engine()
        self._pending.append(request)
        self.stats.requests += 1
        if len(self._running) < self.cost.max_running_requests:
            self._poke()
        try:
            assert request.finished is not None
            await request.finished
        except asyncio.CancelledError:  # the client went away: free its slot
            request.aborted = True
            with contextlib.suppress(ValueError):
                self._pending.remove(request)
            raise
        return 200, self._answer(request)

    def _answer(self, request: _Request) -> dict[str, Any]:
        n = request.done
        if request.aborted and request.rid:
            self._carried[request.rid] = request.prior + n
        spans = request.spans or [[self.version, 0]]
        ends = [s[1] for s in spans[1:]] + [n]
        finish: dict[str, Any] = (
            {"type": "abort"}
            if request.aborted
            else (
                {"type": "length", "length": n}
                if request.hit_limit
                else {"type": "stop", "matched": 2}
            )
        )
        return {
            "text": "",
            "output_ids": [5] * n,
            "meta_info": {
                "id": request.rid,
                "prompt_tokens": request.prompt_ids,
                "completion_tokens": n,
                "finish_reason": finish,
                "output_token_logprobs": [[LOGPROB, 5, None]] * n,
                "weight_version": str(spans[-1][0]),
                "weight_versions": [
                    {"version": str(v), "start": s, "end": e}
                    for (v, s), e in zip(spans, ends, strict=True)
                ],
            },
        }

    def _end_aborted(self, request: _Request) -> None:
        request.aborted = True
        self._finish(request)

    def _finish(self, request: _Request) -> None:
        if request.finished is not None and not request.finished.done():
            request.finished.set_result(None)

    def _ensure_engine(self) -> None:
        if self._engine is None or self._engine.done():
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._idle.set()
            self._engine = asyncio.get_running_loop().create_task(self._run_engine())

    async def aclose(self) -> None:
        if self._engine is not None:
            self._engine.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine

    async def _run_engine(self) -> None:
        assert self._wake is not None and self._idle is not None
        wake, idle, g, cost = self._wake, self._idle, self.g, self.cost
        while True:
            self._running = [r for r in self._running if not r.aborted]
            if self._paused or not (self._running or self._pending):
                idle.set()
                wake.clear()
                await wake.wait()
                continue
            idle.clear()
            joined = 0
            while self._pending and len(self._running) < cost.max_running_requests:
                request = self._pending.popleft()
                if request.aborted:
                    continue
                request.spans = [[self.version, request.done]]
                self._running.append(request)
                joined += request.prompt_ids + request.done
            self.stats.max_running = max(self.stats.max_running, len(self._running))
            if joined:
                prefill = cost.prefill_seconds(joined * g)
                await asyncio.sleep(prefill)
                self.stats.busy_s += prefill
            for request in self._running:
                if request.stop_asked:  # asked during the prefill: it ends before decoding
                    self._end_aborted(request)
            running = self._running = [r for r in self._running if not r.aborted]
            if not running:
                continue
            # Every step until the first of the batch finishes costs about the same.
            steps = min(r.target_ids - r.done for r in running)
            kv = sum(r.prompt_ids + r.done for r in running) + len(running) * steps // 2
            step = cost.step_seconds(len(running), kv * g) * g  # one id = g decode steps
            started = self._loop_time()
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), steps * step)
            done = min(steps, int((self._loop_time() - started) / step + 1e-9))
            if done < steps:  # woken mid-way: end the step under way first
                boundary = started + (done + 1) * step
                await asyncio.sleep(max(0.0, boundary - self._loop_time()))
                done += 1
            self.stats.busy_s += done * step
            self.stats.batch_s += done * step * len(running)
            self.stats.tokens += done * g * len(running)
            still: list[_Request] = []
            for request in running:
                if request.aborted:
                    continue
                request.done += done
                if request.done >= request.target_ids:
                    self._finish(request)
                elif request.stop_asked:
                    self._end_aborted(request)
                else:
                    still.append(request)
            self._running = still


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
