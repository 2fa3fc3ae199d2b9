"""Small helpers for the gateway's hand-written SQL, on a DB-API cursor of either backend.

The hot path (``turns``) and the session lifecycle (``lifecycle``) run their statements
on Django's cursor or on the lane's ``RawCursor``; both carry ``cursor.db`` (the
thread's DatabaseWrapper), which prepares values the way the ORM would. Statements use
``%s`` placeholders on both backends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
from django.db.models import JSONField
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from rl_core.jsonbytes import json_bytes

IN_CHUNK = 500  # ids per ``IN (...)`` list: far below SQLite's variable limit


def as_uuid(value) -> uuid.UUID | None:
    if value is None or isinstance(value, uuid.UUID):
        return value
    return uuid.UUID(str(value))


def loads(value):
    """A JSON column's value: SQLite returns text, PostgreSQL the decoded value."""
    if not isinstance(value, str | bytes):
        return value
    try:
        return orjson.loads(value)  # several times faster on the growing prompt id lists
    except orjson.JSONDecodeError:  # what orjson does not take (integers over 64 bits)
        return json.loads(value)


def as_datetime(value) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_datetime(value)
    return value if timezone.is_aware(value) else timezone.make_aware(value, UTC)


# Values are prepared with ``cursor.db`` rather than the ``connection`` proxy, whose every
# attribute access is a context-local lookup.


def pk(cursor, model, value):
    """A primary key as the database stores it (a hex string on SQLite, a UUID on PostgreSQL)."""
    return model._meta.pk.get_db_prep_value(value, cursor.db)


def value(cursor, model, name: str, raw):
    return model._meta.get_field(name).get_db_prep_save(raw, cursor.db)


def for_update(cursor, *, of: str = "", skip_locked: bool = False) -> str:
    """Row locks where the database has them (SQLite serialises writers instead); ``of``
    names the table (alias) to lock in a join."""
    features = cursor.db.features
    if not features.has_select_for_update:
        return ""
    clause = f" FOR UPDATE OF {of}" if of else " FOR UPDATE"
    if skip_locked and features.has_select_for_update_skip_locked:
        clause += " SKIP LOCKED"
    return clause


def returning(cursor) -> bool:
    """Whether UPDATE ... RETURNING works: a pipelined cursor (the lane on PostgreSQL)
    knows a statement's row count only once its result has been read."""
    return cursor.db.features.can_return_columns_from_insert


def changed_rows(cursor, statement: str, params: list) -> int:
    """Run an UPDATE and return how many rows it changed (``statement`` has no RETURNING)."""
    if returning(cursor):
        cursor.execute(statement + " RETURNING 1", params)
        return len(cursor.fetchall())
    cursor.execute(statement, params)
    return cursor.rowcount


def chunks(items: list, size: int = IN_CHUNK):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def marks(count: int) -> str:
    return ", ".join(["%s"] * count)


@functools.cache
def _insert_statement(model, names: tuple[str, ...]) -> tuple[str, list]:
    fields = [model._meta.get_field(name) for name in names]
    columns = ", ".join(field.column for field in fields)
    return f"INSERT INTO {model._meta.db_table} ({columns}) VALUES ({marks(len(fields))})", fields


def insert(cursor, model, values: dict[str, Any]) -> None:
    """One row of ``model`` from field names to values."""
    statement, fields = _insert_statement(model, tuple(values))
    cursor.execute(
        statement,
        [
            _json(cursor, raw)
            if raw is not None and isinstance(field, JSONField)
            else field.get_db_prep_save(raw, cursor.db)
            for field, raw in ((field, values[field.name]) for field in fields)
        ],
    )


def _json(cursor, raw):
    """A JSON column's parameter, written by ``json_bytes`` (the ORM writes it with the json
    module, slower on the growing message and id lists): text for SQLite, which keeps JSON as
    text; psycopg's ``Jsonb`` for PostgreSQL."""
    data = json_bytes(raw)
    if cursor.db.vendor == "sqlite":
        return data.decode()
    from psycopg.types.json import Jsonb  # PostgreSQL's driver, loaded only where it is used

    return Jsonb(raw, dumps=lambda _: data)


@contextlib.contextmanager
def all_or_nothing(cursor, name: str = "steep_operation"):
    """The statements inside take effect together or not at all.

    A lane operation's ``GatewayError`` is an answer, not a failure: the lane commits the
    batch around it. An operation that writes and may then refuse (ending the session a
    key replaces, then finding the budget full) wraps those steps in a savepoint, so the
    refusal leaves nothing behind on either route.
    """
    cursor.execute(f"SAVEPOINT {name}")
    try:
        yield
    except BaseException:
        cursor.execute(f"ROLLBACK TO SAVEPOINT {name}")
        cursor.execute(f"RELEASE SAVEPOINT {name}")
        raise
    cursor.execute(f"RELEASE SAVEPOINT {name}")
