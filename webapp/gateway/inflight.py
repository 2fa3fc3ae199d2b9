"""Completions still generating, so that a retry of one gets its answer instead of a second turn.

An SDK whose request timed out sends it again (the openai SDK marks the retry with
``X-Stainless-Retry-Count``; any client may send an ``Idempotency-Key`` header, which names the
request across its attempts). Once the first attempt is recorded, the database answers the
retry (``turns.begin``: the session's last turn, or a project key's one-turn completion within
``turns.REPLAY_WINDOW``). While it is still generating, the retry waits here for its answer:
one generation, one turn recorded, the same response to both callers.

Only a retry waits: the same body sent twice without a retry mark or an ``Idempotency-Key`` is
two samples (an agent sampling one prompt several times). A request is known by the caller's
key hash, the agent and its request key (the ``Idempotency-Key``, else the body's
fingerprint), so only the caller holding the same key gets the answer. This is per web
process, a dict and no database statement: a retry that lands on another worker process
while the first attempt still generates is a new sample, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterator

Key = tuple[str, str, str]  # (agent id, key hash, request key)


def request_key(fingerprint: str, idempotency_key: str) -> str:
    """What identifies a request across its attempts: its ``Idempotency-Key`` when sent, else
    its body's fingerprint. Recorded as the turn's ``request_hash``."""
    if not idempotency_key:
        return fingerprint
    return hashlib.sha256(f"idempotency-key\x00{idempotency_key}".encode()).hexdigest()


class InFlight:
    """The answers being generated, by ``Key``; one event loop (a web process's)."""

    def __init__(self) -> None:
        self._pending: dict[Key, asyncio.Future[dict]] = {}

    async def answer(self, key: Key) -> dict | None:
        """The response of the attempt with ``key`` still generating, once recorded; None when
        there is none or it failed (the retry then generates its own)."""
        future = self._pending.get(key)
        if future is None:
            return None
        try:
            return await asyncio.shield(future)
        except Exception:
            return None

    @contextlib.contextmanager
    def track(self, key: Key) -> Iterator[asyncio.Future[dict]]:
        """Register an attempt while it generates; set the future's result to its recorded
        response. Left unset (an error, a cancellation), waiters generate their own."""
        future: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            yield future
        finally:
            if self._pending.get(key) is future:
                del self._pending[key]
            if not future.done():
                future.set_exception(RuntimeError("the first attempt did not finish"))
                future.exception()  # retrieved: no "never retrieved" warning when nobody waits


IN_FLIGHT = InFlight()
