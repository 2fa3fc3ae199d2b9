"""A run's job rides out a web app that is restarting (``workers.job_api.InternalAPI.call``):
refused connections and 5xx are retried until ``retry_s`` runs out; a 4xx is an answer."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from rl_core.inference.process import free_port
from workers.job_api import InternalAPI


class WebApp:
    """An HTTP server answering each request with the next of ``statuses`` (then 200)."""

    def __init__(self, port: int, statuses: list[int]):
        self.requests: list[str] = []
        statuses = list(statuses)
        requests = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                requests.append(self.path)
                status = statuses.pop(0) if statuses else 200
                body = json.dumps({"status": "running", "answered": status}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def api_on(port: int) -> InternalAPI:
    return InternalAPI(f"http://127.0.0.1:{port}", "run-1", "secret", timeout=5)


async def test_a_call_waits_for_a_web_app_that_comes_back():
    port = free_port()
    started: list[WebApp] = []
    # The web app comes up only once the job has met the refused port.
    timer = threading.Timer(1.0, lambda: started.append(WebApp(port, [])))
    timer.start()
    api = api_on(port)
    try:
        answer = await api.call("GET", "config", retry_s=60)
    finally:
        timer.join()
        await api.aclose()
        for app in started:
            app.close()
    assert answer == {"status": "running", "answered": 200}


async def test_5xx_answers_are_retried_until_one_succeeds():
    port = free_port()
    app = WebApp(port, [500, 503, 502])
    api = api_on(port)
    try:
        answer = await api.call("GET", "config", retry_s=60)
    finally:
        await api.aclose()
        app.close()
    assert answer["answered"] == 200
    assert len(app.requests) == 4


async def test_a_4xx_is_an_answer_not_retried():
    port = free_port()
    app = WebApp(port, [401])
    api = api_on(port)
    try:
        with pytest.raises(httpx.HTTPStatusError):
            await api.call("GET", "config", retry_s=60)
    finally:
        await api.aclose()
        app.close()
    assert len(app.requests) == 1


async def test_it_gives_up_once_retry_s_has_run_out():
    api = api_on(free_port())  # nothing ever listens there
    try:
        with pytest.raises(httpx.ConnectError):
            await api.call("GET", "config", retry_s=1.0)
    finally:
        await api.aclose()


@pytest.mark.parametrize(
    ("module", "flag"), [("workers.ray_job", "--run-id"), ("workers.pool_job", "--pool-id")]
)
def test_a_job_started_without_its_secret_refuses_to_start_saying_why(module, flag, monkeypatch):
    import importlib

    monkeypatch.delenv("STEEP_JOB_SECRET", raising=False)
    job = importlib.import_module(module)
    with pytest.raises(SystemExit, match="STEEP_JOB_SECRET is not set"):
        job.main([flag, "0123", "--web-url", "http://127.0.0.1:1"])
