"""An async client for SGLang's native HTTP API (and the torch engine, which speaks it too).

The web process imports this module (the gateway talks to inference servers
through it), so it must never import torch or transformers: it depends on
httpx and httptools (``http1``) only.

A generation that a weight update interrupts is resumed transparently. The
trainer pauses the servers (``/pause_generation``, mode ``abort``), which ends
every in-flight request with ``finish_reason {"type": "abort"}`` and the tokens
generated so far; ``generate`` then resubmits the prompt with those tokens
appended and the remaining ``max_new_tokens`` budget. The server holds the new
request until ``/continue_generation`` (SGLang waits on its pause condition; the
torch engine queues it), so no polling is needed. Every token keeps the weight
version that produced it: ``meta_info.weight_versions`` (per-token spans, when a
weight update landed while the request kept running) or else the segment's
``meta_info.weight_version``; staleness control is measured by these.

The answers' shapes and the errors live in ``rl_core.inference.protocol``; field
names were checked against SGLang's ``python/sglang/srt/entrypoints/http_server.py``
and ``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``,
``PauseGenerationReqInput``, ``UpdateWeightFromDiskReqInput``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from rl_core.ids import new_hex
from rl_core.inference.adapters import AdapterSwitch, adapter_version
from rl_core.inference.http1 import Http1Pool, HTTPConnectionError
from rl_core.inference.protocol import (
    GenerateChunk,
    GenerateResult,
    InferenceError,
    InferenceUnavailable,
    error_from_answer,
    parse_segment,
    parse_weight_version,
    token_versions,
)
from rl_core.inference.sse import newest_sse_data, sse_events
from rl_core.inference.updates import UpdateCalls

__all__ = [
    "GenerateChunk",
    "GenerateResult",
    "InferenceClient",
    "InferenceError",
    "InferenceUnavailable",
    "PooledInferenceClient",
    "parse_weight_version",
]

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params has none

# Servers that answer inside this process, by base URL (``rl_core.sim``'s stand-ins): a
# client of one talks to it through this transport instead of the network, so the code
# above the client (rollout driver, weight sync) runs unchanged against a simulated cluster.
IN_PROCESS_TRANSPORTS: dict[str, httpx.AsyncBaseTransport] = {}


def _ids(input_ids: Sequence[int]) -> list[int]:
    """A copy of ``input_ids`` as Python ints; a list of ints (the gateway's) is copied as it
    is: the prompt of a long session's turn is thousands of ids, every turn."""
    ids = list(input_ids)
    if ids and not (type(ids[0]) is int and type(ids[-1]) is int):  # a tensor's, numpy's
        ids = list(map(int, ids))
    return ids


@dataclass
class _Progress:
    """One generation across its resumed segments: what was asked, what came back so far."""

    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    max_new_tokens: int
    return_logprob: bool
    top_n: int
    lora_path: str | None = None  # the LoRA adapter the next segment runs under (SGLang's field)
    switch: AdapterSwitch | None = None  # moves the next segment onto a newer adapter
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    segments: int = 0
    moves: int = 0  # segments an AdapterSwitch ended, to go on under a newer adapter
    finish: dict | None = None  # the last segment's finish_reason

    @classmethod
    def of(
        cls,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None,
        *,
        rid: str | None,
        return_logprob: bool,
        top_n: int,
        lora_path: str | None = None,
        switch: AdapterSwitch | None = None,
    ) -> _Progress:
        params = dict(sampling_params or {})
        max_new = params.get("max_new_tokens")
        return cls(
            rid=rid or new_hex(),
            input_ids=_ids(input_ids),
            params=params,
            max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else int(max_new),
            return_logprob=return_logprob,
            top_n=top_n,
            lora_path=lora_path,
            switch=switch,
        )

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def body(self, *, stream: bool) -> dict[str, Any]:
        """The next segment's /generate body: the prompt plus everything generated so far."""
        params = dict(self.params)
        params["max_new_tokens"] = self.remaining
        if params.get("min_new_tokens"):
            params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - len(self.output_ids))
        body: dict[str, Any] = {
            "input_ids": self.input_ids + self.output_ids,
            "sampling_params": params,
            "return_logprob": self.return_logprob,
            "logprob_start_len": -1,  # no prompt logprobs: they cost a full-vocab pass per prompt token
            "rid": self.rid,
        }
        if self.top_n:
            body["top_logprobs_num"] = self.top_n
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        if stream:
            body["stream"] = True
        return body

    def revise(self, start: int, meta: dict[str, Any]) -> list[int] | None:
        """The segment from ``start`` on, per the spans of its last event; every token's version
        when they changed what its earlier events said, else None. (A stream that reports
        spans only on its last event, as vLLM's, gave its earlier tokens a provisional one.)"""
        if not meta.get("weight_versions"):
            return None
        versions = token_versions(meta, len(self.output_ids) - start)
        if versions == self.versions[start:]:
            return None
        self.versions[start:] = versions
        return list(self.versions)

    def record(self, chunk: GenerateChunk) -> None:
        self.output_ids += chunk.output_ids
        self.logprobs += chunk.output_logprobs
        self.versions += chunk.versions
        if chunk.top_logprobs:
            self.top += chunk.top_logprobs

    def result(self) -> GenerateResult:
        return GenerateResult(
            rid=self.rid,
            output_ids=self.output_ids,
            output_logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=_finish_type(self.finish, self.remaining),
            matched_stop=(self.finish or {}).get("matched"),
            prompt_tokens=len(self.input_ids),
            text="".join(self.texts),
            num_segments=self.segments,
            top_logprobs=self.top if self.top_n else None,
        )


class InferenceClient(UpdateCalls):
    """Async client for one inference server (SGLang or the torch engine).

    Use as ``async with InferenceClient(url) as client: ...`` or call ``aclose()``.
    Requests to ``/generate`` have no read timeout by default: a generation may
    legitimately wait through a pause and a weight update.
    """

    backend = "sglang"  # the protocol it speaks (the torch engine's too)

    def __init__(
        self,
        base_url: str,
        *,
        timeout: httpx.Timeout | float | None = None,
        max_resumes: int = 64,
        http_client: httpx.AsyncClient | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.max_resumes = max_resumes
        self._own_client = http_client is None
        self._http = http_client or httpx.AsyncClient(
            timeout=timeout if timeout is not None else httpx.Timeout(10.0, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            transport=IN_PROCESS_TRANSPORTS.get(self.base_url),
        )
        self._control_timeout = httpx.Timeout(30.0, read=600.0)  # weight updates can take minutes

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_client:
            await self._http.aclose()

    # ----- transport

    async def _request(
        self, method: str, path: str, *, json_body: Any = None, timeout: Any = None
    ) -> httpx.Response:
        kwargs: dict[str, Any] = {}
        if json_body is not None:
            kwargs["json"] = json_body
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = await self._http.request(method, self.base_url + path, **kwargs)
        except httpx.TransportError as exc:
            raise InferenceUnavailable(f"{method} {self.base_url}{path}: {exc!r}") from exc
        if response.status_code >= 400:
            raise _error_for(response, f"{method} {path}")
        return response

    async def _post_generate(self, body: dict[str, Any]) -> Any:
        """``POST /generate`` (not streaming); the decoded JSON answer."""
        return (await self._request("POST", "/generate", json_body=body)).json()

    # ----- generation

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        top_logprobs_num: int = 0,
        lora_path: str | None = None,
        switch: AdapterSwitch | None = None,
    ) -> GenerateResult:
        """Generate from token ids; resume across aborts; return every token with logprob and version.

        ``sampling_params`` uses SGLang's names (``max_new_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``min_p``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
        ``sampling_seed``, ...). A resumed segment is a new request, so a stop string
        split across the resume point is not detected by the server. Raises
        ``InferenceError`` on a 4xx/5xx answer (some SGLang versions answer an abort
        that way; then the partial output is lost) and ``InferenceUnavailable`` when
        the server cannot be reached.

        ``lora_path`` names a loaded LoRA adapter to generate with (SGLang's field; kept
        across resumed segments); tokens generated under an adapter named ``<prefix>-v<N>``
        (``rl_core.inference.adapters``) are tagged with version ``N``, not the server's.
        With ``switch`` (``AdapterSwitch``), a newer version of the run's adapter takes the
        generation over when it is loaded: the rest is generated, and tagged, under it.
        """
        progress = _Progress.of(
            input_ids,
            sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            top_n=top_logprobs_num,
            lora_path=lora_path,
            switch=switch,
        )
        async for _ in self._resumed(progress, stream=False):
            pass
        return progress.result()

    def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        top_logprobs_num: int = 0,
        lora_path: str | None = None,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Like ``generate`` but yield new tokens as the server streams them (``stream: true``).

        Assumes SGLang's default cumulative streaming (each event carries the whole
        segment so far), which both backends use unless SGLang runs with
        ``--incremental-streaming-output``. The last chunk carries ``finish_reason``.
        """
        progress = _Progress.of(
            input_ids,
            sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            top_n=top_logprobs_num,
            lora_path=lora_path,
        )
        # Closing this stream early closes the server's stream (and ends its request) now.
        # The resume loop itself is the stream: one generator less per token.
        return self._resumed(progress, stream=True)

    async def _resumed(
        self, progress: _Progress, *, stream: bool
    ) -> AsyncGenerator[GenerateChunk, None]:
        """The resume loop of ``generate`` and ``generate_stream``, one request per segment.

        Yields the new tokens of every server answer as a chunk and records them in
        ``progress``. While a segment ends aborted with budget and resumes left, it
        resubmits the prompt plus everything generated so far; each token keeps the
        version of the segment that produced it. The last chunk carries the finish reason.
        """
        switch = progress.switch
        try:
            while True:
                if switch is not None:
                    progress.lora_path = switch.newer(progress.lora_path) or progress.lora_path
                    switch.track(progress.rid, self, progress.lora_path)
                lora_version = adapter_version(progress.lora_path)
                seen, finish, text = 0, None, ""
                start = len(progress.output_ids)  # where this segment's tokens begin
                chunk = GenerateChunk(output_ids=[], output_logprobs=[], versions=[])
                events = self._segment_events(progress.body(stream=stream), stream=stream)
                async with contextlib.aclosing(events):
                    async for data in events:
                        # Each answer carries the whole segment so far; the chunk is what is new.
                        ids, logprobs, versions, finish, top = parse_segment(
                            data,
                            return_logprob=progress.return_logprob,
                            top_n=progress.top_n,
                            start=seen,
                        )
                        if lora_version is not None:  # the adapter's version, not the base's
                            versions = [lora_version] * len(versions)
                        chunk = GenerateChunk(
                            output_ids=ids,
                            output_logprobs=logprobs,
                            versions=versions,
                            top_logprobs=top if progress.top_n else None,
                        )
                        seen, text = seen + len(ids), data.get("text") or ""
                        progress.record(chunk)
                        if finish is not None:
                            if stream and lora_version is None:
                                chunk.revised_versions = progress.revise(start, data["meta_info"])
                            break
                        if chunk.output_ids:
                            yield chunk
                if finish is None and stream:
                    raise InferenceError("the /generate stream ended without a finish_reason")
                progress.segments += 1
                progress.texts.append(text)
                progress.finish = finish
                if switch is not None and _is_abort(finish) and switch.newer(progress.lora_path):
                    progress.moves += 1  # a new adapter took it over: not a resume to limit
                if (
                    _is_abort(finish)
                    and progress.remaining > 0
                    and progress.segments - progress.moves <= self.max_resumes
                ):
                    if chunk.output_ids:
                        yield chunk
                    await self._before_resume(progress, seen)
                    continue
                chunk.finish_reason = _finish_type(finish, progress.remaining)
                chunk.matched_stop = (finish or {}).get("matched")
                yield chunk
                return
        finally:
            if switch is not None:
                switch.untrack(progress.rid)

    async def _before_resume(self, progress: _Progress, new_tokens: int) -> None:
        # A pause makes the resubmitted request wait server-side; this only spaces out
        # retries when aborts keep coming without progress (e.g. an operator abort loop).
        if new_tokens == 0:
            await asyncio.sleep(min(0.05 * 2 ** min(progress.segments, 6), 2.0))

    async def _segment_events(
        self, body: dict[str, Any], *, stream: bool
    ) -> AsyncGenerator[Any, None]:
        """The server's answers to one ``/generate`` request: one, or one per streamed event."""
        if not stream:
            yield await self._post_generate(body)
            return
        # Closed with this generator, so that closing the stream early ends the request now.
        async with contextlib.aclosing(self._stream_events("/generate", body)) as events:
            async for data in events:
                yield data

    async def _stream_events(self, path: str, body: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """The server-sent events of ``POST path`` with ``body``, decoded."""
        try:
            async with self._http.stream("POST", self.base_url + path, json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error_for(response, f"POST {path}")
                async for data in sse_events(response):
                    yield data
        except httpx.TransportError as exc:
            raise InferenceUnavailable(f"POST {self.base_url}{path} (stream): {exc!r}") from exc

    # ----- control

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """Pause the server; with ``mode="abort"`` every in-flight request returns as aborted."""
        response = await self._request(
            "POST", "/pause_generation", json_body={"mode": mode}, timeout=self._control_timeout
        )
        return response.json()

    async def continue_generation(self) -> dict[str, Any]:
        """Resume a paused server; requests held during the pause start running."""
        response = await self._request(
            "POST", "/continue_generation", json_body={}, timeout=self._control_timeout
        )
        return response.json()

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort one request by rid (or all): it returns with finish_reason abort."""
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        await self._request("POST", "/abort_request", json_body=body, timeout=self._control_timeout)

    async def flush_cache(self) -> bool:
        """Flush the prefix cache; False when the server refused (requests were running)."""
        try:
            await self._request("POST", "/flush_cache", timeout=self._control_timeout)
        except InferenceError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    # ----- status

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200; never raises."""
        try:
            response = await self._http.get(
                self.base_url + "/health", timeout=httpx.Timeout(5.0, read=30.0)
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def wait_healthy(self, timeout: float = 300.0, *, interval: float = 0.5) -> None:
        """Poll ``/health`` until it answers 200; raise ``InferenceUnavailable`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise InferenceUnavailable(f"{self.base_url} not healthy after {timeout:.0f}s")
            await asyncio.sleep(interval)

    async def _get_first(self, paths: Sequence[str]) -> dict[str, Any]:
        # Newer SGLang renamed get_model_info/get_server_info (old paths are deprecated aliases).
        for path in paths[:-1]:
            try:
                return (await self._request("GET", path)).json()
            except InferenceError as exc:
                if exc.status != 404:
                    raise
        return (await self._request("GET", paths[-1])).json()

    async def get_model_info(self) -> dict[str, Any]:
        """``model_path``, ``weight_version``, ``is_generation``, ... (``/model_info``)."""
        return await self._get_first(["/model_info", "/get_model_info"])

    async def get_server_info(self) -> dict[str, Any]:
        """Server arguments and ``internal_states`` (``/server_info``)."""
        return await self._get_first(["/server_info", "/get_server_info"])

    async def get_weight_version(self) -> int:
        """The server's current weight version (from ``/model_info``; newest SGLang 404s ``/get_weight_version``)."""
        return parse_weight_version((await self.get_model_info()).get("weight_version"))

    async def slow_down(self, forward_sleep_time: float | None) -> None:
        """Sleep this long after every forward step (SGLang's testing knob); None turns it off."""
        await self._request(
            "POST", "/slow_down", json_body={"forward_sleep_time": forward_sleep_time}
        )


def _is_abort(finish: dict | None) -> bool:
    return isinstance(finish, dict) and finish.get("type") == "abort"


def _finish_type(finish: dict | None, remaining: int) -> str:
    kind = (finish or {}).get("type") or "abort"
    if kind == "abort" and remaining <= 0:
        return "length"  # aborted exactly at the budget: nothing was lost
    return str(kind)


def _error_for(response: httpx.Response, what: str) -> InferenceError:
    return error_from_answer(response.status_code, response.text, what)


class PooledInferenceClient(InferenceClient):
    """``InferenceClient`` whose ``/generate`` calls go through ``Http1Pool``.

    The gateway's hot path: per request, the pool costs a fraction of httpx's CPU and
    latency (docs/benchmarks/gateway.md). Everything else (control calls, streaming) uses httpx
    as the base class does. Create and use it inside one event loop.
    """

    def __init__(self, base_url: str, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self._pool = Http1Pool(self.base_url)

    async def _post_generate(self, body: dict[str, Any]) -> Any:
        try:
            status, payload = await self._pool.post_json("/generate", orjson.dumps(body))
        except HTTPConnectionError as exc:
            raise InferenceUnavailable(f"POST {self.base_url}/generate: {exc}") from exc
        if status >= 400:
            raise error_from_answer(status, payload.decode("utf-8", "replace"), "POST /generate")
        try:
            return orjson.loads(payload)
        except ValueError:
            raise InferenceError(
                f"POST /generate: the answer is not JSON: {payload[:200]!r}"
            ) from None

    async def _segment_events(
        self, body: dict[str, Any], *, stream: bool
    ) -> AsyncGenerator[Any, None]:
        if not stream:
            yield await self._post_generate(body)
            return
        # The gateway's streamed completions: the pool here too (httpx's per-event work was
        # most of a streamed token's cost in the gateway, docs/benchmarks/gateway.md).
        pieces = self._pool.post_stream("/generate", orjson.dumps(body))
        try:
            async with contextlib.aclosing(pieces):
                status = await anext(pieces)
                if status >= 400:
                    payload = b"".join([piece async for piece in pieces])
                    raise error_from_answer(
                        status, payload.decode("utf-8", "replace"), "POST /generate"
                    )
                buffer, final = b"", False
                try:
                    async for piece in pieces:
                        buffer += piece
                        *lines, buffer = buffer.split(b"\n")
                        # Each event carries the whole segment so far, so of the events that
                        # arrived together only the newest says anything new: a gateway that
                        # fell behind parses and forwards one event, not all of them.
                        data = newest_sse_data(lines)
                        if data is not None:
                            final = (data.get("meta_info") or {}).get("finish_reason") is not None
                            yield data
                finally:
                    if final:  # only "[DONE]" is left: read it, and the connection is reused
                        async for _ in pieces:
                            pass
        except HTTPConnectionError as exc:
            raise InferenceUnavailable(f"POST {self.base_url}/generate (stream): {exc}") from exc

    async def aclose(self) -> None:
        await self._pool.close()
        await super().aclose()
