"""The ASGI fast route (``webapp.gateway.asgi``): chat completions without Django's request
stack, with what Django's middleware did for them (request id, body limit, security
headers, host and HTTPS checks) done there too; every other request goes to Django.

The first tests go through the live server; the rest call the ASGI apps in-process with
requests that never reach the database (405s, 413s, fallthroughs).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from webapp.gateway import asgi as fast
from webapp.gateway.models import Interaction, Session
from webapp.runs.models import Run

HI = [{"role": "user", "content": "Hi"}]
CHAT = json.dumps({"messages": HI, "max_tokens": 2})
SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
}
FRESH_ID = re.compile(r"[0-9a-f]{32}")


def _assert_security_headers(headers) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert headers.get(name) == value, (name, dict(headers))


# --------------------------------------------------------------------------- live server


@pytest.mark.django_db(transaction=True)
def test_a_completion_echoes_the_request_id_and_carries_the_security_headers(gw):
    response = gw.post("/chat/completions", content=CHAT, headers={"X-Request-ID": "ep-7.turn:1"})

    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "ep-7.turn:1"
    _assert_security_headers(response.headers)
    assert Interaction.objects.get().id == response.json()["id"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "incoming",
    [None, "", "has spaces", "-leading-dash", "x" * 129, "semi;colon"],
    ids=["absent", "empty", "spaces", "leading-dash", "too-long", "semicolon"],
)
def test_a_missing_or_insane_request_id_is_replaced_by_a_fresh_one(gw, incoming):
    headers = {} if incoming is None else {"X-Request-ID": incoming}
    first = gw.post("/chat/completions", content=CHAT, key=None, headers=headers)
    second = gw.post("/chat/completions", content=CHAT, key=None, headers=headers)

    assert first.status_code == second.status_code == 401
    ids = first.headers["x-request-id"], second.headers["x-request-id"]
    assert all(FRESH_ID.fullmatch(i) for i in ids), ids
    assert ids[0] != ids[1]


@pytest.mark.django_db(transaction=True)
def test_every_answer_of_the_chat_path_carries_the_request_id_and_security_headers(
    gw, server_env, openai_error
):
    limit = int(server_env["MAX_REQUEST_BYTES"])
    answers = {
        "no key": (gw.post("/chat/completions", content=CHAT, key=None), 401),
        "bad json": (gw.post("/chat/completions", content="{"), 400),
        "too large": (gw.post("/chat/completions", content=b"x" * (limit + 1)), 413),
        "chunked too large": (
            gw.post("/chat/completions", content=(b"x" * 8192 for _ in range(limit // 8192 + 1))),
            413,
        ),
        "GET": (gw.http.get(gw.base_url + "/chat/completions"), 405),
    }
    for name, (response, status) in answers.items():
        error = openai_error(response, status)
        assert FRESH_ID.fullmatch(response.headers["x-request-id"]), name
        _assert_security_headers(response.headers)
        if status == 413:
            assert error["code"] == "request_too_large" and str(limit) in error["message"]
    assert not Session.objects.exists() and not Interaction.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_host_not_allowed_is_refused_by_django_and_nothing_is_served(gw, settings):
    if "*" in settings.ALLOWED_HOSTS:
        pytest.skip("the server allows every host")
    response = gw.post("/chat/completions", content=CHAT, headers={"Host": "evil.example.com"})

    assert response.status_code == 400  # Django's DisallowedHost
    assert not Session.objects.exists() and not Interaction.objects.exists()
    assert Run.objects.get(pk=gw.run.pk).sessions_open == 0


@pytest.mark.django_db(transaction=True)
def test_each_chat_request_writes_one_log_line_with_its_id_path_and_status(gw, tmp_path_factory):
    [log] = tmp_path_factory.getbasetemp().glob("gateway[0-9]*/uvicorn.log")  # gateway_url's log
    request_id = f"log-check-{time.monotonic_ns()}"
    response = gw.post("/chat/completions", content="{", headers={"X-Request-ID": request_id})
    assert response.status_code == 400

    deadline = time.monotonic() + 5  # the line is written after the answer is sent
    while True:
        lines = [line for line in log.read_text().splitlines() if request_id in line]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(lines) == 1, lines
    assert f"POST /agents/{gw.agent.id}/v1/chat/completions 400" in lines[0]


# --------------------------------------------------------------------------- in-process


class Exchange:
    """One ASGI request: a scope, a receive fed from ``messages``, and what was sent."""

    def __init__(
        self,
        path: str = "/agents/a1/v1/chat/completions",
        *,
        method: str = "POST",
        headers: dict[str, str] | None = None,
        messages: list[dict] | None = None,
        scheme: str = "http",
    ) -> None:
        headers = {"host": "127.0.0.1:8000"} | (headers or {})
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": scheme,
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        self.messages = list(messages or [{"type": "http.request", "body": b""}])
        self.received = 0
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        self.received += 1
        if self.messages:
            return self.messages.pop(0)
        await asyncio.Event().wait()  # the client neither sends more nor leaves
        raise AssertionError("unreachable")

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def run(self, app) -> Exchange:
        asyncio.run(app(self.scope, self.receive, self.send))
        return self

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]}

    def json(self) -> dict:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


class FakeDjango:
    """Stands in for Django: records what reaches it and answers 299."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def test_the_asgi_application_sends_only_an_agents_calls_to_the_fast_route(monkeypatch):
    from webapp.asgi import application
    from webapp.gateway.replies import Reply

    served: list[tuple[str, str]] = []

    def recording(name):
        async def endpoint(agent_id, headers, body) -> Reply:
            served.append((name, agent_id))
            return Reply(299)

        return endpoint

    for name in list(fast.ENDPOINTS):
        monkeypatch.setitem(fast.ENDPOINTS, name, recording(name))

    names = [
        "chat/completions",
        "responses",
        "messages",
        "rl/start_session",
        "rl/set_reward",
        "rl/end_session",
    ]
    for name in names:
        assert Exchange(f"/agents/a1/v1/{name}").run(application).status == 299
    assert served == [(name, "a1") for name in names]
    health = Exchange("/healthz", method="GET").run(application)
    assert (health.status, health.json()) == (200, {"status": "ok"})
    # Near misses are Django's too (it answers 404 or redirects; the fast route is not asked).
    for path in [
        "/agents/a1/v1/chat/completions/",
        "/agents/a1/v1/chat/completion",
        "/agents/a1/v1/rl/start_session/",
        "/agents/a1/v1/models",
        "/agents/a1/v1/messages/",
        "/agents/a1/messages",
    ]:
        assert Exchange(path).run(application).status in (301, 401, 404, 405)
    assert len(served) == len(names)


def test_a_get_is_405_in_openais_shape():
    django = FakeDjango()
    exchange = Exchange(method="GET", headers={"x-request-id": "r-1"}).run(fast.fast_route(django))

    assert exchange.status == 405 and django.paths == []
    assert exchange.json()["error"]["code"] == "method_not_allowed"
    assert exchange.headers["x-request-id"] == "r-1"


def test_a_body_announced_over_the_limit_is_413_before_any_of_it_is_read(settings):
    settings.MAX_REQUEST_BYTES = 1024
    exchange = Exchange(headers={"content-length": "1025"}).run(fast.fast_route(FakeDjango()))

    assert exchange.status == 413 and exchange.received == 0
    error = exchange.json()["error"]
    assert error["code"] == "request_too_large" and "1024" in error["message"]
    _assert_security_headers(exchange.headers)


def test_a_chunked_body_is_cut_off_as_soon_as_it_passes_the_limit(settings):
    settings.MAX_REQUEST_BYTES = 1024
    endless = [{"type": "http.request", "body": b"x" * 512, "more_body": True}] * 100
    exchange = Exchange(messages=endless).run(fast.fast_route(FakeDjango()))

    assert exchange.status == 413
    assert exchange.received == 3  # 512, 1024 (at the limit), 1536: over


def test_a_client_gone_before_its_body_arrived_gets_no_answer():
    gone = [
        {"type": "http.request", "body": b"{", "more_body": True},
        {"type": "http.disconnect"},
    ]
    exchange = Exchange(messages=gone).run(fast.fast_route(FakeDjango()))
    assert exchange.sent == []


def test_requests_django_must_answer_fall_through_to_it(settings):
    settings.ALLOWED_HOSTS = ["gateway.example.com"]
    django = FakeDjango()
    app = fast.fast_route(django)

    assert Exchange(method="GET", headers={"host": "evil.example.com"}).run(app).status == 299
    assert Exchange(method="GET", headers={"host": ""}).run(app).status == 299
    allowed = Exchange(method="GET", headers={"host": "gateway.example.com:443"}).run(app)
    assert allowed.status == 405
    assert len(django.paths) == 2


def test_behind_a_tls_proxy_plain_http_goes_to_django_and_https_gets_hsts(settings):
    settings.ALLOWED_HOSTS = ["gateway.example.com"]
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SECURE_HSTS_SECONDS = 3600
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    settings.SECURE_HSTS_PRELOAD = False
    django = FakeDjango()
    app = fast.fast_route(django)
    host = {"host": "gateway.example.com"}

    assert Exchange(method="GET", headers=host).run(app).status == 299  # to be redirected
    plain = Exchange(method="GET", headers=host | {"x-forwarded-proto": "http"}).run(app)
    assert plain.status == 299
    secure = Exchange(method="GET", headers=host | {"x-forwarded-proto": "https"}).run(app)
    assert secure.status == 405
    assert secure.headers["strict-transport-security"] == "max-age=3600; includeSubDomains"
    assert len(django.paths) == 2


def test_plain_http_answers_carry_no_hsts(settings):
    settings.SECURE_HSTS_SECONDS = 3600
    exchange = Exchange(method="GET").run(fast.fast_route(FakeDjango()))
    assert exchange.status == 405
    assert "strict-transport-security" not in exchange.headers
