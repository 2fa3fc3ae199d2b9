"""Every request has an id (the caller's ``X-Request-ID`` or a new one), echoed in the response
and carried by every log line made while serving it; ``LOG_FORMAT=json`` writes JSON lines."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import re
import sys
import urllib.request

import pytest

from tests.livestack import LiveStack, answers, free_port, steep_env
from webapp.observability import JsonFormatter, RequestIdFilter


@pytest.fixture
def json_log():
    """Records of ``steep.request`` and ``django.request`` as the json handler writes them."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    loggers = [logging.getLogger(name) for name in ("steep.request", "django.request")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)

    def lines() -> list[dict]:
        return [json.loads(line) for line in stream.getvalue().splitlines()]

    yield lines
    for logger, level in zip(loggers, levels, strict=True):
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_an_incoming_request_id_is_echoed(client):
    response = client.get("/healthz", HTTP_X_REQUEST_ID="lb-7f3a.42")
    assert response["X-Request-ID"] == "lb-7f3a.42"


def test_a_request_without_one_gets_a_fresh_id(client):
    first, second = client.get("/healthz")["X-Request-ID"], client.get("/healthz")["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second


@pytest.mark.parametrize("bad", ["two words", "x" * 200, 'quote"d', "-leading-dash", "ünïcode"])
def test_an_unsafe_incoming_id_is_replaced(client, bad):
    # The id ends up in log lines: only short tokens of safe characters are kept.
    assert re.fullmatch(
        r"[0-9a-f]{32}", client.get("/healthz", HTTP_X_REQUEST_ID=bad)["X-Request-ID"]
    )


@pytest.mark.django_db
def test_log_lines_of_a_request_carry_its_id(client, json_log):
    response = client.get("/api/v1/project/", HTTP_X_REQUEST_ID="req-42")
    assert response.status_code == 401 and response["X-Request-ID"] == "req-42"
    lines = json_log()
    access = [line for line in lines if line["logger"] == "steep.request"]
    assert len(access) == 1
    assert access[0] | {"time": None, "duration_ms": None} == {
        "time": None,
        "level": "INFO",
        "logger": "steep.request",
        "message": "GET /api/v1/project/ 401",
        "request_id": "req-42",
        "method": "GET",
        "path": "/api/v1/project/",
        "status": 401,
        "duration_ms": None,
    }
    # Django logs 4xx responses after the middleware chain returns: the id is still there.
    django_lines = [line for line in lines if line["logger"] == "django.request"]
    assert django_lines and all(line["request_id"] == "req-42" for line in django_lines)


async def test_async_views_get_and_echo_ids_too(async_client):
    # The gateway's views are async: the middleware runs in the event loop for them.
    response = await async_client.post(
        "/agents/00000000-0000-0000-0000-000000000000/v1/rl/end_session",
        headers={"X-Request-ID": "agent-run-9"},
    )
    assert response.status_code == 401
    assert response["X-Request-ID"] == "agent-run-9"


def test_outside_a_request_the_id_is_a_dash():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    # A fresh context: what a thread that never served a request sees (an earlier test's
    # test-client request may have left its id in this thread's context).
    contextvars.Context().run(RequestIdFilter().filter, record)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello world" and line["request_id"] == "-"


def test_json_lines_include_extras_and_exceptions():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    record.run_id = "r-1"
    line = json.loads(JsonFormatter().format(record))
    assert line["run_id"] == "r-1" and "ValueError: boom" in line["exception"]


LOG_ONE = "import logging\nlogging.getLogger('steep.test').warning('hello', extra={'run_id': 'r1'})"


def test_log_format_json_writes_one_json_object_per_line(tmp_path, production_env, run_django):
    result = run_django(LOG_ONE, production_env(tmp_path, LOG_FORMAT="json"))
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stderr.strip().splitlines()[-1])
    assert line["level"] == "WARNING" and line["logger"] == "steep.test"
    assert line["message"] == "hello" and line["request_id"] == "-" and line["run_id"] == "r1"


def test_log_format_plain_is_one_readable_line(tmp_path, production_env, run_django):
    result = run_django(LOG_ONE, production_env(tmp_path, LOG_FORMAT="plain"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("WARNING steep.test [-] hello")


@pytest.mark.parametrize("log_format", ["plain", "json"])
def test_a_request_through_the_real_server_is_logged_once(tmp_path, log_format):
    # uvicorn logs every request too, unless told not to: one line per request is Steep's.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with LiveStack(
        env=steep_env(data_dir=tmp_path, LOG_FORMAT=log_format), log_dir=tmp_path
    ) as stack:
        web = stack.start(  # as ./steep web starts it
            "web",
            [sys.executable, "-m", "uvicorn", "webapp.asgi:application", "--host", "127.0.0.1",
             "--port", str(port), "--lifespan", "off"],
        )  # fmt: skip
        stack.wait_ready(
            web,
            lambda: answers(f"{url}/readyz", 200) or answers(f"{url}/readyz", 503),
            what="uvicorn",
        )
        request = urllib.request.Request(f"{url}/healthz", headers={"X-Request-ID": "once-42"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request) as response:
            assert response.status == 200
        # Both would be written before the response: Steep's line, then uvicorn's at its start.
        lines = [line for line in stack.logs["web"].read_text().splitlines() if "/healthz" in line]
    assert len(lines) == 1, lines
    assert "once-42" in lines[0] and "steep.request" in lines[0]
