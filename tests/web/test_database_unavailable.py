"""A database that cannot be reached (restarting, gone) answers 503 with Retry-After, never a
500: the REST API in its error shape, pages in plain text (``DatabaseUnavailableMiddleware``).
The gateway's own answer to the same is checked live in ``tests/chaos/test_postgres_restart.py``.

The outage is real: the connection is closed and pointed at a database that does not exist
(a file in a missing folder on SQLite, an unknown database on PostgreSQL), so the next query
fails in the driver as it does when the server is down.
"""

from __future__ import annotations

import contextlib

import pytest

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def database_down():
    from django.db import connection

    real = connection.settings_dict["NAME"]
    connection.close()
    missing = (
        "/nonexistent-steep-dir/steep.sqlite3" if connection.vendor == "sqlite" else "steep_gone"
    )
    connection.settings_dict["NAME"] = missing
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["NAME"] = real


def test_the_rest_api_answers_503_with_retry_after_while_the_database_is_down(api, api_error):
    with database_down():
        response = api.get("/api/v1/runs/")
    error = api_error(response, 503)
    assert error["code"] == "database_unavailable"
    assert response["Retry-After"] == "1"
    assert api.get("/api/v1/runs/").status_code == 200  # and it is back at once


def test_a_page_answers_503_with_retry_after_while_the_database_is_down(member_client):
    with database_down():
        response = member_client.get("/")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert b"database is unavailable" in response.content
