"""``/healthz``: the process is up. ``/readyz``: the database, the broker and (when
``RAY_ADDRESS`` is set) the Ray cluster answer; 503 with per-check results otherwise."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import OperationalError

from webapp import health


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def test_healthz_answers_any_host_without_touching_the_database(client):
    # No django_db mark: pytest-django fails any database access here.
    response = client.get("/healthz", HTTP_HOST="10.42.0.17")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert client.get("/healthz/").status_code == 200


@pytest.mark.django_db
def test_readyz_is_200_when_database_and_broker_answer(client):
    response = client.get("/readyz", HTTP_HOST="10.42.0.17")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "ok"
    assert set(body["checks"]) == {"database", "broker"}  # no RAY_ADDRESS: no ray check
    assert all(check["ok"] and check["ms"] >= 0 for check in body["checks"].values())


@pytest.mark.django_db
def test_readyz_is_503_when_the_database_fails(client, monkeypatch):
    def down():
        raise OperationalError("connection refused")

    monkeypatch.setattr(health, "check_database", down)
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"] == {
        "ok": False,
        "error": "OperationalError",
        "ms": body["checks"]["database"]["ms"],
    }
    assert body["checks"]["broker"]["ok"] is True  # the other checks still report
    assert "connection refused" not in response.content.decode()  # details go to the log only


@pytest.mark.django_db
def test_readyz_is_503_when_redis_does_not_answer(client, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{closed_port()}/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["broker"]["ok"] is False


@pytest.mark.django_db
def test_readyz_is_503_when_the_broker_folder_is_gone(client, settings, tmp_path):
    settings.REDIS_URL = ""
    settings.DATA_DIR = tmp_path / "nowhere"  # no broker/ folder to write to
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["broker"]["ok"] is False


@pytest.fixture
def fake_ray_dashboard():
    """A Jobs API stand-in that requires ``Authorization: Bearer good-token``."""
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            ok = self.path == "/api/version" and seen[-1] == "Bearer good-token"
            body = json.dumps({"ray_version": "test"} if ok else {}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.seen = seen
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.django_db
def test_readyz_checks_ray_with_the_token_when_ray_address_is_set(
    client, settings, monkeypatch, fake_ray_dashboard
):
    settings.RAY_ADDRESS = f"http://127.0.0.1:{fake_ray_dashboard.server_port}"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "good-token")
    response = client.get("/readyz")
    assert response.status_code == 200, response.content
    assert response.json()["checks"]["ray"]["ok"] is True
    assert fake_ray_dashboard.seen == ["Bearer good-token"]


@pytest.mark.django_db
def test_readyz_is_503_when_ray_refuses_the_token(
    client, settings, monkeypatch, fake_ray_dashboard
):
    settings.RAY_ADDRESS = f"http://127.0.0.1:{fake_ray_dashboard.server_port}"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "stale-token")
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["ray"] == {
        "ok": False,
        "error": "HTTPStatusError",
        "ms": response.json()["checks"]["ray"]["ms"],
    }


@pytest.mark.django_db
def test_readyz_is_503_when_ray_is_unreachable(client, settings, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    settings.RAY_ADDRESS = f"http://127.0.0.1:{closed_port()}"
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["ray"]["ok"] is False


def test_readyz_is_503_when_postgres_is_unreachable(tmp_path, production_env, run_django):
    # A real database failure, not a patched one: a server that is not there.
    env = production_env(tmp_path, DATABASE_URL=f"postgres://steep@127.0.0.1:{closed_port()}/steep")
    code = """
import json
from django.test import Client
response = Client().get("/readyz", HTTP_HOST="steep.example.com", HTTP_X_FORWARDED_PROTO="https")
print(json.dumps([response.status_code, response.json()]))
"""
    result = run_django(code, env)
    assert result.returncode == 0, result.stderr
    status, body = json.loads(result.stdout.strip().splitlines()[-1])
    assert status == 503
    assert body["checks"]["database"]["ok"] is False
    assert body["checks"]["database"]["error"] == "OperationalError"
    assert body["checks"]["broker"]["ok"] is True


@pytest.mark.django_db(transaction=True)
async def test_probes_answer_over_asgi_too(async_client):
    # Under uvicorn the middleware runs in the event loop; readyz's checks in a worker thread.
    assert (await async_client.get("/healthz")).status_code == 200
    response = await async_client.get("/readyz", headers={"Host": "10.42.0.17"})
    assert response.status_code == 200, response.content
    assert response.json()["checks"]["database"]["ok"] is True
