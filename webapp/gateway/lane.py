"""The gateway's database lane: one thread per web process that runs the hot path's SQL.

Chat completions reach the database twice (``webapp.gateway.turns``: authenticate and
admit, then record the turn). Each is an *operation*: a function of a DB-API cursor that
reads, writes and returns plain data, or raises. Operations are queued to this
process's lane thread, which takes everything queued, runs it in **one transaction** and commits
once: group commit. Operations raise ``GatewayError`` only before writes that must not
stay (``turns.begin`` keeps a key's ``last_used_at`` even when it then refuses); any other
failure (in an operation or at the commit) rolls the batch back and its operations are
retried one transaction each, so one bad operation never undoes the others; a database
error reaches its caller as ``LaneError``. Only after the commit returns are the callers' futures
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
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections, transaction

from webapp.gateway.errors import GatewayError, database_unavailable

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
        self._synchronous: tuple[int, str] | None = None  # (connection, PRAGMA synchronous)
        self.batches = 0  # statistics, for tests and benchmarks
        self.operations = 0

    async def run(self, operation: Operation[T], *, durable: bool = True) -> T:
        """Run ``operation(cursor)`` in the lane; return its result once its batch has committed.

        ``durable=False``: the operation's writes may be lost in a power failure or OS crash
        (not in a process crash). Such a batch commits without waiting for the disk unless a
        durable operation shares it; the next durable commit makes them durable too.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._ensure_started()
        self._queue.put((operation, loop, future, durable))
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
            # One wake-up per event loop and batch, not per operation: each is a syscall.
            by_loop: dict[Any, list] = {}
            for (_, loop, future, _), outcome in zip(batch, outcomes, strict=True):
                by_loop.setdefault(loop, []).append((future, outcome))
            for loop, settled in by_loop.items():
                loop.call_soon_threadsafe(_settle_all, settled)

    def _run_batch(self, batch: list) -> list[tuple[bool, Any]]:
        """Run the batch in one transaction. If anything fails but a GatewayError (which
        operations raise before they write), roll the batch back and run each operation in
        a transaction of its own: the others still take effect, and the failing one gets
        its own error (a database error as ``LaneError``)."""
        durable = any(entry[3] for entry in batch)
        try:
            outcomes = self._transaction([entry[0] for entry in batch], durable)
        except Exception as exc:
            if len(batch) == 1:
                return [self._failed(exc)]
            logger.warning(
                "gateway lane: a batch of %d failed (%r); retrying one by one", len(batch), exc
            )
            outcomes = []
            for operation, _, _, durable in batch:
                try:
                    outcomes += self._transaction([operation], durable)
                except Exception as exc:
                    outcomes.append(self._failed(exc))
        self.batches += 1
        self.operations += len(batch)
        return outcomes

    def _transaction(self, operations: list, durable: bool) -> list[tuple[bool, Any]]:
        """One transaction on the lane's connection, driven directly (BEGIN ... COMMIT on the
        driver's cursor): Django's transaction machinery costs more than these statements.

        On PostgreSQL the transaction runs in psycopg's pipeline mode: statements whose
        results nobody reads (the inserts, the COMMIT) go out without waiting for the
        server, so a batch costs a few round trips instead of one per statement.
        """
        db = connections[DEFAULT_DB_ALIAS]  # this thread's: the lane's own connection
        db.ensure_connection()
        driver_cursor = _server_binding(db) if db.vendor == "postgresql" else db.create_cursor()
        cursor = RawCursor(driver_cursor, db)
        try:
            if db.vendor == "sqlite":
                level = "FULL" if durable else "NORMAL"  # WAL: FULL syncs the log per commit
                if self._synchronous != (id(db.connection), level):
                    # busy_timeout 0: _begin_immediate waits for the write lock itself.
                    cursor.execute("PRAGMA busy_timeout = 0")
                    cursor.execute(f"PRAGMA synchronous = {level}")
                    self._synchronous = (id(db.connection), level)
                self._begin_immediate(cursor, db)
                return self._statements(cursor, operations, [])
            begin = ["BEGIN"] if durable else ["BEGIN", "SET LOCAL synchronous_commit TO OFF"]
            try:
                with db.connection.pipeline():
                    return self._statements(cursor, operations, begin)
            except BaseException:
                db.close()  # a pipeline that failed half-way is not worth untangling
                self._synchronous = None
                raise
        finally:
            # Closed at once, not when garbage collected: an exception's traceback can keep
            # it alive, and an unfinished SQLite statement holds its read lock.
            try:
                driver_cursor.close()
            except Exception:  # already closed with its connection
                pass

    @staticmethod
    def _begin_immediate(cursor: RawCursor, db) -> None:
        """Take SQLite's write lock, retrying every few hundred microseconds while another
        process holds it. SQLite's own busy handler sleeps 1, 2, 5, 10... ms between tries,
        so a lane losing the race to another web process's lane fell ever further behind."""
        deadline = time.monotonic() + float(db.settings_dict.get("OPTIONS", {}).get("timeout", 30))
        while True:
            try:
                cursor.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(random.uniform(0.0001, 0.0005))

    @staticmethod
    def _statements(
        cursor: RawCursor, operations: list, begin: list[str]
    ) -> list[tuple[bool, Any]]:
        for statement in begin:
            cursor.execute(statement)
        outcomes: list[tuple[bool, Any]] = []
        try:
            for operation in operations:
                try:
                    outcomes.append((True, operation(cursor)))
                except GatewayError as exc:
                    outcomes.append((False, exc))
                except Exception as exc:
                    raise _Unexpected(exc) from exc
            # A COMMIT can fail (SQLite checks deferred foreign keys there) and leave the
            # transaction open, holding the write lock: it is rolled back like the rest.
            cursor.execute("COMMIT")
        except BaseException:
            try:
                cursor.execute("ROLLBACK")
            except Exception:  # nothing to roll back, or the connection is gone
                pass
            raise
        return outcomes

    def _failed(self, exc: Exception) -> tuple[bool, Exception]:
        """The outcome of an operation whose transaction failed."""
        error = exc.error if isinstance(exc, _Unexpected) else exc
        if not isinstance(error, DB_ERRORS):
            logger.error("gateway lane: an operation failed", exc_info=error)
            return False, error  # a bug, not the database: the caller sees it as it is
        logger.error("gateway lane: the database refused an operation: %r", error)
        connections[DEFAULT_DB_ALIAS].close()  # reconnect next time (e.g. after a restart)
        self._synchronous = None
        return False, LaneError(f"The database did not accept the write ({type(error).__name__}).")


def _server_binding(db):
    """A psycopg cursor that sends the parameters apart from the statement, unlike Django's
    (which writes them into its text, in Python, and PostgreSQL parses them back). The
    lane's statements are a few constant strings, so psycopg also prepares each one on the
    connection at its fifth run, and PostgreSQL stops parsing and planning it per request,
    unless DATABASE_URL sets ``prepare_threshold`` (Django's default, None, turns preparing
    off for its own cursors: a PgBouncer older than 1.21 in transaction mode cannot keep
    prepared statements: add ``?prepare_threshold=none`` to DATABASE_URL there)."""
    import psycopg

    if "prepare_threshold" not in db.settings_dict["OPTIONS"]:
        db.connection.prepare_threshold = 5
    return psycopg.Cursor(db.connection)


class _Unexpected(Exception):
    def __init__(self, error: Exception):
        super().__init__(repr(error))
        self.error = error


def _database_errors() -> tuple[type[Exception], ...]:
    errors: list[type[Exception]] = [DatabaseError, sqlite3.Error]
    try:
        import psycopg

        errors.append(psycopg.Error)
    except ImportError:
        pass
    return tuple(errors)


DB_ERRORS = _database_errors()  # Django's and the drivers' (the lane uses raw cursors)


_QMARK: dict[str, str] = {}  # SQLite: statements with %s rewritten to ?


class RawCursor:
    """The driver's cursor under Django's wrapper, with ``db`` (the DatabaseWrapper) kept.

    Operations use ``%s`` placeholders on both backends (Django's SQLite cursor converts
    them) and ``cursor.db`` to prepare values; skipping the wrapper's per-statement
    instrumentation is a tenth of the lane's CPU. Driver exceptions are not translated.
    """

    __slots__ = ("_cursor", "db", "execute", "fetchone", "fetchall")

    def __init__(self, cursor, db):
        self._cursor = cursor
        self.db = db
        self.execute = self._sqlite_execute if db.vendor == "sqlite" else cursor.execute
        self.fetchone = cursor.fetchone
        self.fetchall = cursor.fetchall

    def _sqlite_execute(self, query: str, params=None):
        # Django's SQLite cursor rewrites %s to ? with a regex at every call; the gateway's
        # statements are a handful of constant strings, so rewrite each once.
        if params is None:
            return sqlite3.Cursor.execute(self._cursor, query)
        converted = _QMARK.get(query)
        if converted is None:
            converted = _QMARK[query] = self._cursor.convert_query(query)
        return sqlite3.Cursor.execute(self._cursor, converted, params)

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount


class LaneError(Exception):
    """A batch could not be committed; the caller's operation did not take effect."""


def _settle_all(settled: list[tuple[asyncio.Future, tuple[bool, Any]]]) -> None:
    for future, (ok, value) in settled:
        if future.cancelled():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


async def in_thread(operation: Operation[T], *, durable: bool = True) -> T:
    """Run an operation in its own transaction through ``sync_to_async`` (thread-sensitive:
    on the request's own connection, which is what Django's test client needs). Django's
    routes use this; the ASGI fast route uses the lane. Every commit here is durable."""
    return await sync_to_async(in_transaction, thread_sensitive=True)(operation)


def in_transaction(operation: Operation[T]) -> T:
    """Run an operation in a transaction (a savepoint inside one) on this thread's connection."""
    with transaction.atomic(), connection.cursor() as cursor:
        return operation(cursor)


_LANE = Lane()


def lane() -> Lane:
    """This process's lane."""
    return _LANE


async def in_lane(operation: Operation[T], *, durable: bool = True) -> T:
    """Run an operation in this process's lane; a batch that could not commit is a 503. The
    agent endpoints' ``db`` on the ASGI fast route (Django's views pass ``in_thread``)."""
    try:
        return await lane().run(operation, durable=durable)
    except LaneError as exc:
        raise database_unavailable(str(exc)) from None
