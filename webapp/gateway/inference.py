"""Calling a run's inference servers: what a turn asks them for (``engine_request``), routing,
failover, and the n parallel samples of a request."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections

from rl_core.inference.adapters import current_adapter, role_prefix
from rl_core.inference.client import (
    GenerateResult,
    InferenceClient,
    InferenceError,
    InferenceUnavailable,
)
from rl_core.inference.vllm import client_for
from webapp.gateway import selectors
from webapp.gateway.caches import CACHES, SERVERS_TTL_S
from webapp.gateway.errors import GatewayError
from webapp.gateway.lane import DB_ERRORS
from webapp.gateway.services import inference_server_mark_down, inference_server_mark_up
from webapp.pools import limits as pool_limits

if TYPE_CHECKING:
    from rl_core.chat import ChatTokenizer
    from webapp.gateway.chat_request import ChatRequest
    from webapp.gateway.turns import RunInfo


def engine_request(
    chat: ChatRequest,
    tok: ChatTokenizer,
    run: RunInfo,
    sticky: str,
    input_ids: list[int],
    role: str = "",
) -> dict:
    """What the run's inference servers are asked for (``generate``'s and ``generate_stream``'s
    arguments); ``role``: the multi-agent run's role whose adapter answers."""
    max_new = min(chat.max_tokens, settings.GATEWAY_MAX_NEW_TOKENS)
    return {
        "run_id": run.id,
        "sticky": sticky,
        "input_ids": input_ids,
        "sampling_params": chat.sampling_params(
            max_new_tokens=max_new, stop_token_ids=tok.eos_token_ids
        ),
        "n": chat.n,
        "seed": chat.seed,
        "top_logprobs": chat.top_logprobs,
        # A LoRA run serves each policy version as its own adapter (rl_core.adapter_sync), and
        # a multi-agent run one per role.
        "lora_path": current_adapter(
            role_prefix(str(run.id), role),
            run.weight_version,
            lora_rank=int(run.config.get("lora_rank") or 0),
            init_checkpoint=run.config.get("init_checkpoint"),
        ),
        "pool": run.config.get("inference_pool") or "",
    }


def _in_thread(function):
    """``function`` run in a worker thread. A database error closes that thread's connection:
    no request cycle closes it there, so after a database restart it would stay broken and
    every later call would fail; the next call reconnects instead."""

    def call(**kwargs):
        try:
            return function(**kwargs)
        except DB_ERRORS:
            connections.close_all()
            raise

    return sync_to_async(call, thread_sensitive=False)


def order_candidates(
    servers: list[tuple[str, bool, str]], sticky: str
) -> list[tuple[str, bool, str]]:
    """The session's own server first, then the least loaded in this process."""
    return sorted(servers, key=lambda server: (server[0] != sticky, CACHES.in_flight[server[0]]))


async def _candidates(run_id, sticky: str) -> list[tuple[str, bool, str]]:
    cached = CACHES.servers.get(run_id)
    if cached is not None and cached[0] > time.monotonic():
        return order_candidates(cached[1], sticky)
    # When the entry expires under load, one request reads the list; the others wait for it.
    key = (id(asyncio.get_running_loop()), run_id)
    reading = CACHES.server_reads.get(key)
    if reading is None:
        reading = CACHES.server_reads[key] = asyncio.ensure_future(_read_servers(run_id))
        reading.add_done_callback(lambda _: CACHES.server_reads.pop(key, None))
    servers = await asyncio.shield(reading)
    return order_candidates(servers, sticky)


async def _read_servers(run_id) -> list[tuple[str, bool, str]]:
    servers = await _in_thread(selectors.server_candidates)(run_id=run_id)
    if servers:  # an empty list is not cached: a server attached now is used at once
        CACHES.servers[run_id] = (time.monotonic() + SERVERS_TTL_S, servers)
    return servers


async def _mark_down(run_id, url: str) -> None:
    CACHES.servers.pop(run_id, None)
    await _in_thread(inference_server_mark_down)(run_id=run_id, url=url)


def _client(url: str, backend: str) -> InferenceClient:
    # One pooled HTTP client per event loop and server: HTTP clients are bound to their loop.
    key = (id(asyncio.get_running_loop()), url)
    client = CACHES.clients.get(key)
    if client is None or (client.backend == "vllm") != (backend == "vllm"):
        client = CACHES.clients[key] = client_for(backend, url, pooled=True)
    return client


def _request_id() -> str:
    """A unique id for an engine request (SGLang's ``rid``): not a secret, so no syscall."""
    return f"{random.getrandbits(128):032x}"


@dataclass
class Generation:
    server_url: str
    results: list[GenerateResult]


async def generate(
    *,
    run_id,
    sticky: str,
    input_ids: list[int],
    sampling_params: dict,
    n: int,
    seed: int | None,
    top_logprobs: int,
    lora_path: str | None = None,
    pool: str = "",
) -> Generation:
    """Sample ``n`` answers on one server (the session's, else the least loaded); fail over on a dead one.

    ``pool``: the shared inference pool the run is on, whose per-run request limit applies."""
    taken = await pool_limits.take(run_id, pool, n)
    try:
        return await _generate(
            run_id, sticky, input_ids, sampling_params, n, seed, top_logprobs, lora_path
        )
    except GatewayError as exc:
        raise _named_pool(exc, pool) from None
    finally:
        pool_limits.give_back(run_id, taken)


async def _generate(
    run_id, sticky, input_ids, sampling_params, n, seed, top_logprobs, lora_path
) -> Generation:
    candidates = await _candidates(run_id, sticky)
    if not candidates:
        raise _no_server()
    last_error: Exception | None = None
    for url, healthy, backend in candidates:
        client = _client(url, backend)
        CACHES.in_flight[url] += n
        try:
            results = await asyncio.gather(
                *(
                    client.generate(
                        input_ids,
                        params,
                        rid=_request_id(),
                        top_logprobs_num=top_logprobs,
                        lora_path=lora_path,
                    )
                    for params in _per_sample(sampling_params, n, seed)
                )
            )
        except (InferenceError, InferenceUnavailable) as exc:
            _raise_if_rejected(exc)
            last_error = exc
            await _mark_down(run_id, url)
            continue
        finally:
            CACHES.in_flight[url] -= n
        await _back_in_rotation(run_id, url, healthy)
        return Generation(server_url=url, results=list(results))
    raise _all_failed(last_error)


class StreamingGeneration:
    """``n`` streamed samples on one server, each begun (its first chunk read) before any is sent.

    ``chunks()`` yields ``(choice index, GenerateChunk)`` as the engine produces them; ``abort()``
    asks the server to stop the unfinished ones (SGLang's ``abort_request`` by rid).
    """

    def __init__(self, run_id, url: str, client, rids: list[str], firsts, streams, version: int):
        self.run_id, self.server_url, self.client = run_id, url, client
        self.rids, self.firsts, self.streams, self.version = rids, firsts, streams, version
        self.done = [first.finish_reason is not None for first in firsts]
        self.closed = False
        self.pool_taken = 0  # requests counted against the run's pool limit (pool_limits)
        self._pumps: list[asyncio.Future] = []  # n > 1: one task reading each stream

    async def chunks(self):
        try:
            for index, first in enumerate(self.firsts):
                yield index, first
            live = [i for i, done in enumerate(self.done) if not done]
            if len(live) == 1:  # the usual n = 1: no task, no queue between engine and client
                async for chunk in self.streams[live[0]]:
                    self.done[live[0]] = chunk.finish_reason is not None
                    yield live[0], chunk
            elif live:
                async for index, chunk in self._merged(live):
                    yield index, chunk
        finally:
            await self.close()

    async def _merged(self, live: list[int]):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for chunk in self.streams[index]:
                    queue.put_nowait((index, chunk, None))
            except Exception as exc:
                queue.put_nowait((index, None, exc))
            queue.put_nowait((index, None, None))

        self._pumps = [asyncio.ensure_future(pump(index)) for index in live]
        try:
            remaining = len(live)
            while remaining:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    remaining -= 1
                    continue
                self.done[index] = chunk.finish_reason is not None
                yield index, chunk
        finally:
            await self._stop_pumps()

    async def _stop_pumps(self) -> None:
        # A stream a pump is still reading cannot be closed from here: end the pumps first.
        pumps, self._pumps = self._pumps, []
        for task in pumps:
            task.cancel()
        if pumps:
            await asyncio.gather(*pumps, return_exceptions=True)

    async def abort(self) -> None:
        """Abort the unfinished samples on the engine; never raises."""
        for rid, done in zip(self.rids, self.done, strict=True):
            if not done:
                try:
                    await self.client.abort_request(rid)
                except (InferenceError, InferenceUnavailable):
                    pass  # its stream closing ends it too (both engines abort on disconnect)
        await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        CACHES.in_flight[self.server_url] -= len(self.streams)
        pool_limits.give_back(self.run_id, self.pool_taken)
        await self._stop_pumps()
        for stream in self.streams:
            await stream.aclose()


async def generate_stream(
    *,
    run_id,
    sticky: str,
    input_ids: list[int],
    sampling_params: dict,
    n: int,
    seed: int | None,
    top_logprobs: int,
    lora_path: str | None = None,
    pool: str = "",
) -> StreamingGeneration:
    """Begin ``n`` streamed samples on one server (as ``generate`` picks it), failing over
    while none has produced a token yet. The pool's request limit is held until it closes."""
    taken = await pool_limits.take(run_id, pool, n)
    try:
        generation = await _generate_stream(
            run_id, sticky, input_ids, sampling_params, n, seed, top_logprobs, lora_path
        )
    except BaseException as exc:
        pool_limits.give_back(run_id, taken)
        if isinstance(exc, GatewayError):
            raise _named_pool(exc, pool) from None
        raise
    generation.pool_taken = taken
    return generation


async def _generate_stream(
    run_id, sticky, input_ids, sampling_params, n, seed, top_logprobs, lora_path
) -> StreamingGeneration:
    candidates = await _candidates(run_id, sticky)
    if not candidates:
        raise _no_server()
    last_error: Exception | None = None
    for url, healthy, backend in candidates:
        client = _client(url, backend)
        CACHES.in_flight[url] += n
        rids, streams = [], []
        for params in _per_sample(sampling_params, n, seed):
            rids.append(_request_id())
            streams.append(
                client.generate_stream(
                    input_ids,
                    params,
                    rid=rids[-1],
                    top_logprobs_num=top_logprobs,
                    lora_path=lora_path,
                )
            )
        try:
            if n == 1:  # in this task: the stream's connection is then used by one task only
                firsts = [await anext(streams[0])]
            else:
                firsts = list(await asyncio.gather(*(anext(stream) for stream in streams)))
        except BaseException as exc:
            CACHES.in_flight[url] -= n
            for stream in streams:
                await stream.aclose()
            if not isinstance(exc, InferenceError | InferenceUnavailable):
                raise
            _raise_if_rejected(exc)
            last_error = exc
            await _mark_down(run_id, url)
            continue
        await _back_in_rotation(run_id, url, healthy)
        version = max((max(f.versions, default=0) for f in firsts), default=0)
        return StreamingGeneration(run_id, url, client, rids, firsts, streams, version)
    raise _all_failed(last_error)


def _per_sample(sampling_params: dict, n: int, seed: int | None) -> list[dict]:
    """Each of the ``n`` samples' parameters: with a ``seed``, sample ``i`` gets ``seed + i``."""
    if seed is None:
        return [dict(sampling_params) for _ in range(n)]
    return [sampling_params | {"sampling_seed": seed + index} for index in range(n)]


def _raise_if_rejected(exc: Exception) -> None:
    """A 4xx from the server is the request's fault (a 400 to the agent), not the server's."""
    if isinstance(exc, InferenceError) and exc.status is not None and 400 <= exc.status < 500:
        raise GatewayError(
            400, f"The inference server rejected the request: {exc}", code="invalid_request"
        ) from None


async def _back_in_rotation(run_id, url: str, healthy: bool) -> None:
    """A server that answered after its back-off is in rotation again."""
    if not healthy:
        CACHES.servers.pop(run_id, None)
        await _in_thread(inference_server_mark_up)(run_id=run_id, url=url)


def _no_server() -> GatewayError:
    return GatewayError(
        503,
        "No inference server is up for this run yet; it is starting or has stopped. Retry shortly.",
        code="no_inference_server",
        retry_after=5,
    )


def _named_pool(exc: GatewayError, pool: str) -> GatewayError:
    """A run on a shared pool with no server up: a 503 that says it is the pool."""
    if not pool or exc.code != "no_inference_server":
        return exc
    return GatewayError(
        503,
        f"Inference pool '{pool}' has no server up for this run: the pool is stopped or "
        "starting, or the run is starting. Retry shortly; Steep's operators can check it "
        "with ./steep manage pool_list.",
        code="pool_unavailable",
        retry_after=5,
    )


def _all_failed(last_error: Exception | None) -> GatewayError:
    return GatewayError(
        503,
        f"Every inference server of this run failed ({last_error}). Retry shortly.",
        code="inference_unavailable",
        retry_after=5,
    )
