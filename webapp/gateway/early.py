"""A stream's engine request started beside its begin trip (``completions``).

A project key's stream whose caller had a one-turn stream served in the last ``EARLY_TTL_S``
starts its engine request at once, made for the run that served that stream, while the begin
trip (authentication and admission) runs (``begin_beside``). The early generation is used only
if the trip's answer asks for the very same request (``inference.engine_request``: run, version
and adapter, prompt ids, sampling); otherwise, or when the trip refuses, it is aborted on the
engine and nothing of it is recorded. The time to the first token then no longer includes the
trip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from rl_core.chat import ChatTemplateError
from webapp.gateway import turns
from webapp.gateway.caches import CACHES
from webapp.gateway.chat_request import ChatRequest
from webapp.gateway.inference import StreamingGeneration, engine_request, generate_stream
from webapp.gateway.prompts import fresh_prompt


class EarlyRuns:
    """The run each project key's last one-turn stream was served by, for ``EARLY_TTL_S``: a
    stream of the same caller starts its engine request with it while the begin trip runs."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, str], tuple[float, turns.RunInfo]] = {}

    def remember(self, caller_key: tuple[str, str], run: turns.RunInfo) -> None:
        if len(self._runs) > 10_000:  # forget the expired now and then
            now = time.monotonic()
            self._runs = {k: v for k, v in self._runs.items() if v[0] > now}
        self._runs[caller_key] = (time.monotonic() + EARLY_TTL_S, run)

    def forget(self, caller_key: tuple[str, str]) -> None:
        self._runs.pop(caller_key, None)

    def get(self, caller_key: tuple[str, str]) -> turns.RunInfo | None:
        found = self._runs.get(caller_key)
        return found[1] if found is not None and found[0] > time.monotonic() else None


EARLY_TTL_S = 10.0
EARLY_RUNS = EarlyRuns()


@dataclass
class EarlyStream:
    """An engine request started before the begin trip answered, on the caller's last run.

    It is used only when what the begin trip then says makes the very same request (same run,
    version, adapter, prompt ids and sampling); otherwise, or when the begin trip refuses, it
    is aborted. The time to the first token then no longer includes the begin trip."""

    request: dict
    task: asyncio.Future

    async def take(self, request: dict) -> StreamingGeneration | None:
        """The early generation when ``request`` is what it asked for; else None (dropped)."""
        if request != self.request:
            await self.drop()
            return None
        return await self.task

    async def drop(self) -> None:
        """Abort the early request, wherever it is; never raises."""
        if not self.task.done():
            self.task.cancel()  # closes its stream, which aborts it on the engine
        try:
            generation = await self.task
        except BaseException:  # noqa: BLE001 (cancelled or failed: nothing to abort)
            return
        await generation.abort()


def early_request(chat: ChatRequest, caller_key: tuple[str, str]) -> dict | None:
    """The engine request to start early for a stream whose caller's last one-turn stream was
    served recently (``EARLY_RUNS``), made as for that run; None when there is none."""
    run = EARLY_RUNS.get(caller_key)
    if run is None or run.config.get("roles"):  # a role is only known once the trip returns
        return None
    tok = CACHES.tokenizers.get(run.base_model)
    if tok is None:
        return None
    try:
        input_ids = fresh_prompt(tok, chat.messages, chat.rendered_tools).input_ids
    except ChatTemplateError:
        return None
    return engine_request(chat, tok, run, "", input_ids)


async def begin_beside(
    trip: Awaitable[turns.Turn], ahead: dict, caller_key: tuple[str, str]
) -> tuple[turns.Turn, EarlyStream | None]:
    """The begin ``trip``, then the engine request ``ahead`` started beside it: the turn, and the
    early stream to offer its engine request to (None for a retry's replay, which drops it). A
    refused trip drops it too, and no stream of the caller starts early until one is served."""
    begun = asyncio.ensure_future(trip)
    early = EarlyStream(ahead, asyncio.ensure_future(generate_stream(**ahead)))
    try:
        turn = await begun
    except BaseException:
        begun.cancel()
        EARLY_RUNS.forget(caller_key)
        await early.drop()
        raise
    if turn.replay is not None:
        await early.drop()
        return turn, None
    return turn, early
