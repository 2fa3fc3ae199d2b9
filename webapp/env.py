"""Typed readers for environment variables. A bad value fails loudly at start-up."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def envstr(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def envbool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use true or false.")


def envint(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip().replace("_", ""))
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a whole number.") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}.")
    return value


def envsecret(name: str) -> str:
    """Read ``NAME`` or, for Docker/Kubernetes secrets, the file named by ``NAME_FILE``."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={path!r} cannot be read: {exc}") from None
    return os.environ.get(name, "")


def envlist(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def database_from_url(url: str) -> dict:
    """Turn ``postgres://user:pass@host:port/name`` or ``sqlite:///path`` into a DATABASES entry."""
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        # As in dj-database-url: sqlite:///relative.db, sqlite:////absolute/path.db.
        path = unquote(parsed.path)[1:]
        if not path or path == "/":
            raise ImproperlyConfigured(
                "DATABASE_URL=sqlite:///... needs a file path, e.g. sqlite:////data/steep.sqlite3."
            )
        # As the embedded default: without IMMEDIATE, concurrent writers fail at once
        # with "database is locked" instead of waiting for the lock.
        options = {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL;",
        }
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": path, "OPTIONS": options}
    if parsed.scheme in {"postgres", "postgresql", "pgsql"}:
        name = unquote(parsed.path.lstrip("/"))
        if not name:
            raise ImproperlyConfigured(
                f"DATABASE_URL {url!r} names no database; add /DBNAME at the end."
            )
        options: dict = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
        if "prepare_threshold" in options:  # psycopg takes a number, or None: never prepare
            value = options["prepare_threshold"].strip().lower()
            if value not in ("none", "off") and not value.isdigit():
                raise ImproperlyConfigured(
                    f"DATABASE_URL's prepare_threshold={value!r}: use a number of runs, or none."
                )
            options["prepare_threshold"] = None if value in ("none", "off") else int(value)
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 0,  # ASGI: connections are per request thread; reuse leaks them
            "CONN_HEALTH_CHECKS": True,
        }
    raise ImproperlyConfigured(
        f"DATABASE_URL scheme {parsed.scheme!r} is not supported; use postgres://... or sqlite:///..."
    )
