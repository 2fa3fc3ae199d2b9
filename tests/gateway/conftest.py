"""Fixtures for the gateway tests: a live ASGI server, a torch engine serving the tiny model,
and agents wired to them. Tests talk to the gateway over real HTTP with the official
``openai`` SDK (or httpx for what the SDK cannot send).

- ``gateway_url``: uvicorn serving ``webapp.asgi`` in a subprocess on 127.0.0.1, on the
  pytest-django test database (so every test that calls it needs
  ``django_db(transaction=True)``: the server only sees committed rows), with
  ``SERVER_ENV`` in its environment (also the ``server_env`` fixture).
- ``tiny_model_dir``, ``perturbed_model_dir``: the tiny model and a noised copy ("the next
  policy version").
- ``engine``: the torch engine serving the tiny model at weight version 0, shared by every
  test; ``load_weights(engine, model_dir, version)`` swaps its weights (a test that does
  restores them).
- ``make_gateway(project, key, ...)``: a running run bound to an engine and an agent on
  it, as a ``Gateway`` (base_url, SDK clients, raw posts); ``gw`` is one for ``project``.
- ``openai_error(response, status)``: checks OpenAI's error shape and returns ``error``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rl_core.inference.launch import TorchEngineServer
from tests.conftest import test_database_url
from tests.livestack import LiveStack, answers, free_port, steep_env

# The server's own settings: a short idle timeout (only the expiry test relies on it), a
# small body limit (so an oversize body is cheap to send) and a recognisable Retry-After.
SERVER_ENV = {
    "SESSION_IDLE_TIMEOUT_S": "2",
    "MAX_REQUEST_BYTES": "65536",
    "GATEWAY_RETRY_AFTER_S": "3",
}


@pytest.fixture(scope="session")
def server_env() -> dict[str, str]:
    """The settings the live server runs with (``SERVER_ENV``)."""
    return dict(SERVER_ENV)


# --------------------------------------------------------------------------- models


# --------------------------------------------------------------------------- engines


@pytest.fixture(scope="session")
def engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TorchEngineServer]:
    server = TorchEngineServer(
        tiny_model_dir,
        host="127.0.0.1",
        weight_version=0,
        num_threads=1,
        log_path=tmp_path_factory.mktemp("engine") / "engine.log",
    )
    server.start()  # not waiting: it boots while the web server does (see make_gateway)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def load_weights() -> Callable[..., None]:
    """``load(engine, model_dir, version)``: the engine serves ``model_dir``'s weights (same
    shapes) as weight ``version`` from now on. Who loads into the shared engine restores it."""

    def load(server: TorchEngineServer, model_dir: str | Path, version: int) -> None:
        server.wait_healthy(timeout=120)
        response = httpx.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(model_dir), "weight_version": str(version)},
            timeout=120,
        )
        assert response.status_code == 200 and response.json()["success"], response.text

    return load


# --------------------------------------------------------------------------- the live server


@pytest.fixture(scope="session")
def gateway_url(django_db_setup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a uvicorn subprocess serving the web app on the test database."""
    from django.conf import settings

    env = steep_env(
        data_dir=settings.DATA_DIR,
        database_url=test_database_url(),
        redis_url=settings.REDIS_URL,
        **SERVER_ENV,
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    probe = f"{url}/agents/00000000-0000-0000-0000-000000000000/v1/models"
    with LiveStack(env=env, log_dir=tmp_path_factory.mktemp("gateway")) as processes:
        web = processes.start_web(port, name="uvicorn")
        processes.wait_ready(web, lambda: answers(probe, 401), what="uvicorn")
        yield url


# --------------------------------------------------------------------------- agents


@dataclass
class Gateway:
    """An agent of a running run, and ways to call its base_url."""

    server: str
    project: Any
    key: str  # the project key
    run: Any
    agent: Any
    model_dir: Path
    http: httpx.Client
    _clients: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"{self.server}/agents/{self.agent.id}/v1"

    @property
    def model(self) -> str:
        """What the SDK sends as ``model`` (the gateway serves the run's policy whatever it says)."""
        return self.model_dir.name

    def openai(self, key: str | None = None, **kwargs: Any):
        """An SDK client on this agent's base_url with ``key`` (the project key by default)."""
        from openai import OpenAI

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        client = OpenAI(base_url=self.base_url, api_key=key or self.key, **kwargs)
        self._clients.append(client)
        return client

    def post(
        self,
        path: str,
        body: Any = None,
        *,
        key: str | None = "",
        content: bytes | str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST ``{base_url}{path}`` with ``key`` as bearer (project key by default, None: none)."""
        headers = dict(headers or {})
        bearer = self.key if key == "" else key
        if bearer is not None:
            headers["Authorization"] = f"Bearer {bearer}"
        if content is not None:
            headers.setdefault("Content-Type", "application/json")
            return self.http.post(self.base_url + path, content=content, headers=headers)
        return self.http.post(self.base_url + path, json=body, headers=headers)

    def start_session(self, key: str | None = "", **body: Any) -> tuple[str, str]:
        response = self.post("/rl/start_session", body, key=key)
        assert response.status_code == 201, response.text
        data = response.json()
        return data["session_id"], data["api_key"]

    def close(self) -> None:
        for client in self._clients:
            client.close()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


@pytest.fixture
def make_gateway(
    engine, gateway_url: str, tiny_model_dir: Path, make_run, make_agent, http
) -> Iterator[Callable[..., Gateway]]:
    """``make(project, key, *, servers=None, model_dir=tiny_model_dir, run=None,
    running=True, name="agent", **run_config) -> Gateway``.

    ``servers``: URLs to register instead of ``engine.url`` (in this order), as ``backend``'s
    servers; ``run``: bind the agent to an existing run instead of creating one.
    """
    from webapp.gateway.services import inference_server_register
    from webapp.runs.services import run_mark_running

    made: list[Gateway] = []

    def make(
        project,
        key: str,
        *,
        servers: list[str] | None = None,
        model_dir: Path = tiny_model_dir,
        run=None,
        running: bool = True,
        name: str = "agent",
        backend: str = "torch",
        **config: Any,
    ) -> Gateway:
        if backend == "torch":
            engine.wait_healthy(timeout=120)
        if run is None:
            run = make_run(project, name=f"{name}-run", base_model=str(model_dir), **config)
            for url in servers if servers is not None else [engine.url]:
                inference_server_register(run=run, url=url, backend=backend)
            if running:
                run = run_mark_running(run=run, message="test")
        agent = make_agent(project, name=name, run=run)
        gateway = Gateway(gateway_url, project, key, run, agent, Path(model_dir), http)
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        gateway.close()


@pytest.fixture
def gw(make_gateway, project, api_key) -> Gateway:
    """An agent of ``project`` on a running run served by the shared ``engine``."""
    return make_gateway(project, api_key)


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_model_dir: Path):
    from rl_core.chat import load_chat_tokenizer

    return load_chat_tokenizer(str(tiny_model_dir))


def _openai_error(response, status: int) -> dict:
    """Assert ``response`` (httpx response or SDK APIStatusError) is OpenAI's error shape."""
    response = getattr(response, "response", response)
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


@pytest.fixture
def openai_error() -> Callable[[Any, int], dict]:
    return _openai_error
