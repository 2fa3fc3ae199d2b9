"""Request ids and log formatting.

Every request gets an id: the caller's ``X-Request-ID`` when it is a sane token, else a
new one. It is echoed in the response's ``X-Request-ID``, kept in a context variable
for the duration of the request (so every log record made while serving it, in the
event loop or in the worker threads ORM calls run in, carries it as ``request_id``)
and written in one ``steep.request`` log line per request. ``LOG_FORMAT=json`` turns
each record into one JSON object per line. ``LOG_CONSOLE=quiet`` (``./steep up``) keeps the
console for people: warnings, errors and ``steep.status`` lines (``log_status``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextvars import ContextVar
from datetime import UTC, datetime

from asgiref.sync import iscoroutinefunction
from django.utils.decorators import sync_and_async_middleware

from rl_core.ids import new_hex

request_id_var: ContextVar[str] = ContextVar("request_id", default="-")
request_logger = logging.getLogger("steep.request")
# What a person at the terminal follows: runs and pools changing status (``log_status``).
status_logger = logging.getLogger("steep.status")

HEADER = "X-Request-ID"
_SANE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=+/@-]{0,127}")


def request_id_for(incoming: str | None) -> str:
    """The caller's id if it is a short token of safe characters (it ends up in logs), else a new one."""
    if incoming and _SANE.fullmatch(incoming):
        return incoming
    return new_hex()


class RequestIdFilter(logging.Filter):
    """Give every record a ``request_id`` (``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


class ConsoleFilter(logging.Filter):
    """``LOG_CONSOLE=quiet``: the console keeps warnings, errors and ``steep.status`` lines; the
    rest (a line per request, per Celery task, per demo episode) goes to ``LOG_FILE`` only."""

    def __init__(self, quiet: bool = False) -> None:
        super().__init__()
        self.quiet = quiet

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            not self.quiet or record.levelno >= logging.WARNING or record.name == status_logger.name
        )


def log_status(kind: str, name: str, status: str, detail: str = "") -> None:
    """A run or pool's new status as one ``steep.status`` line; a failure is a warning."""
    level = logging.WARNING if status == "failed" else logging.INFO
    status_logger.log(level, "%s '%s': %s%s", kind, name, status, f" ({detail})" if detail else "")


# Attributes every LogRecord has; anything else was passed in ``extra=`` and is logged too.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "request_id",
    "taskName",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, request_id, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", request_id_var.get()),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_"):
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def log_request(method: str, path: str, status: int, started: float) -> None:
    """The request's log line (``steep.request``, INFO), with its duration since ``started``."""
    request_logger.info(
        "%s %s %s",
        method,
        path,
        status,
        extra={
            "method": method,
            "path": path,
            "status": status,
            "duration_ms": round((time.perf_counter() - started) * 1000, 2),
        },
    )


def _log(request, response, started: float) -> None:
    log_request(request.method, request.path, getattr(response, "status_code", 0), started)


def _forget(token) -> None:
    try:
        request_id_var.reset(token)
    except ValueError:  # closed in another context than it was set in
        request_id_var.set("-")


@sync_and_async_middleware
def request_id_middleware(get_response):
    """Outermost middleware: the request id, its response header and the request's log line.

    The id is not reset on the way out: Django logs 4xx/5xx responses after the middleware
    chain returns, and those lines need it too. Under ASGI each request runs in its own task,
    so the value never outlives its request; under WSGI it is reset when the response closes.
    """

    if iscoroutinefunction(get_response):

        async def middleware(request):
            started = time.perf_counter()
            request.request_id = request_id_for(request.headers.get(HEADER))
            request_id_var.set(request.request_id)
            response = await get_response(request)
            response[HEADER] = request.request_id
            _log(request, response, started)
            return response

    else:

        def middleware(request):
            started = time.perf_counter()
            request.request_id = request_id_for(request.headers.get(HEADER))
            token = request_id_var.set(request.request_id)
            response = get_response(request)
            response[HEADER] = request.request_id
            _log(request, response, started)
            # A WSGI thread serves one request after another: forget the id once the
            # server closes the response (after Django's own log lines).
            response._resource_closers.append(lambda: _forget(token))
            return response

    return middleware
