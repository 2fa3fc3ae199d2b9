"""The gateway's database lane: one thread per web process that runs the hot path's SQL.

Chat completions reach the database twice (``webapp.gateway.turns``: authenticate and
admit, then record the turn). Each is an *operation*: a function of a DB-API cursor that
reads, writes and returns plain data, or raises. Operations are queued to this
process's lane thread, which takes everything queued, runs it in **one transaction**
(each operation inside its own savepoint, so one failure does not undo the others) and
commits once: group commit. Only after the commit returns are the callers' futures
resolved, so nothing is acknowledged before it is durable, and under load one fsync
(SQLite) or one commit round trip (PostgreSQL) covers many requests.

The lane has its own Django database connection (connections are per thread), opened
with the project's settings. On SQLite its transactions are ``BEGIN IMMEDIATE``
(settings), so the lane holds the write lock for the batch and reads inside an operation
see what it then writes. On PostgreSQL, operations that read-then-write lock what they
read (``SELECT ... FOR UPDATE``; see ``turns``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connection, transaction

logger = logging.getLogger(__name__)

T = TypeVar("T")
Operation = Callable[[Any], T]

MAX_BATCH = 256  # operations per transaction: bounds how long one commit holds the write lock


class Lane:
    """A thread that runs queued database operations, committing them in groups."""

    def __init__(self, name: str = "steep-gateway-db"):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0  # statistics, for tests and benchmarks
        self.operations = 0

    async def run(self, operation: Operation[T]) -> T:
        """Run ``operation(cursor)`` in the lane; return its result once its batch has committed."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._ensure_started()
        self._queue.put((operation, loop, future))
        return await future

    def _ensure_started(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            outcomes = self._run_batch(batch)
            for (_, loop, future), outcome in zip(batch, outcomes, strict=True):
                loop.call_soon_threadsafe(_settle, future, outcome)

    def _run_batch(self, batch: list) -> list[tuple[bool, Any]]:
        outcomes: list[tuple[bool, Any]] = []
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                for operation, _, _ in batch:
                    savepoint = transaction.savepoint()
                    try:
                        outcomes.append((True, operation(cursor)))
                    except Exception as exc:
                        transaction.savepoint_rollback(savepoint)
                        outcomes.append((False, exc))
                    else:
                        transaction.savepoint_commit(savepoint)
        except (
            Exception
        ) as exc:  # the commit (or the connection) failed: nothing in the batch stands
            logger.exception("gateway lane: a batch of %d operations was rolled back", len(batch))
            if isinstance(exc, DatabaseError):
                connection.close()  # reconnect on the next batch (e.g. after a database restart)
            error = LaneError(f"The database did not accept the write ({type(exc).__name__}).")
            return [(False, error)] * len(batch)
        self.batches += 1
        self.operations += len(batch)
        return outcomes


class LaneError(Exception):
    """A batch could not be committed; the caller's operation did not take effect."""


def _settle(future: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if future.cancelled():
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


async def in_thread(operation: Operation[T]) -> T:
    """Run an operation in its own transaction through ``sync_to_async`` (thread-sensitive:
    on the request's own connection, which is what Django's test client needs). Django's
    routes use this; the ASGI fast route uses the lane."""
    return await sync_to_async(_atomically, thread_sensitive=True)(operation)


def _atomically(operation: Operation[T]) -> T:
    with transaction.atomic(), connection.cursor() as cursor:
        return operation(cursor)


_LANE = Lane()


def lane() -> Lane:
    """This process's lane."""
    return _LANE
