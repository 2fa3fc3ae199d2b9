"""Serving: 503s that say what to start, failover from dead servers, and what servers send back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.management import call_command
from openai import InternalServerError

from rl_core.inference.launch import free_port
from webapp.gateway.inference import SERVERS_TTL_S
from webapp.gateway.models import InferenceServer, Interaction, Session
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]
IM_END = 258  # the tiny tokenizer: 256 bytes, then <|endoftext|>, <|im_start|>, <|im_end|>, <|pad|>


class FakeEngine:
    """An SGLang-protocol server on 127.0.0.1 that answers /generate with canned output ids
    (or a canned HTTP status), to make an engine say what a real one rarely does."""

    def __init__(self) -> None:
        self.output_ids: list[int] = [104, 105, IM_END]
        self.status = 200
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                ids = fake.output_ids
                payload = {
                    "text": "",
                    "output_ids": ids,
                    "meta_info": {
                        "id": body.get("rid"),
                        "finish_reason": {"type": "stop", "matched": ids[-1]},
                        "prompt_tokens": len(body["input_ids"]),
                        "completion_tokens": len(ids),
                        "weight_version": "0",
                        "output_token_logprobs": [[-0.5, t, None] for t in ids],
                    },
                }
                if fake.status != 200:
                    payload = {"error": {"message": "engine exploded"}}
                data = json.dumps(payload).encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_engine() -> Iterator[FakeEngine]:
    fake = FakeEngine()
    yield fake
    fake.close()


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def _assert_nothing_recorded() -> None:
    assert not Session.objects.exists() and not Interaction.objects.exists()


def test_a_run_that_is_not_running_is_503_saying_what_to_start(
    make_gateway, project, api_key, openai_error
):
    gw = make_gateway(project, api_key, running=False)
    with pytest.raises(InternalServerError) as exc:
        gw.openai().chat.completions.create(model=gw.model, messages=HI)
    error = openai_error(exc.value, 503)
    assert error["code"] == "run_not_running" and error["type"] == "service_unavailable_error"
    assert "draft, not running" in error["message"]
    assert f"/api/v1/runs/{gw.run.id}/start/" in error["message"]
    assert openai_error(gw.post("/rl/start_session"), 503)["code"] == "run_not_running"

    Run.objects.filter(pk=gw.run.pk).update(status=Run.Status.STOPPED)
    assert "stopped, not running" in openai_error(gw.post("/rl/start_session"), 503)["message"]
    _assert_nothing_recorded()


def test_an_agent_without_a_run_is_503(make_gateway, project, api_key, openai_error):
    gw = make_gateway(project, api_key)
    gw.agent.run = None
    gw.agent.save(update_fields=["run"])
    error = openai_error(gw.post("/chat/completions", {"messages": HI}), 503)
    assert error["code"] == "no_run" and "Bind it to a run" in error["message"]
    assert gw.openai().models.list().data == []
    _assert_nothing_recorded()


def test_no_registered_server_is_503_with_retry_after_and_records_nothing(
    make_gateway, project, api_key, openai_error
):
    gw = make_gateway(project, api_key, servers=[])
    response = gw.post("/chat/completions", {"messages": HI})
    error = openai_error(response, 503)
    assert error["code"] == "no_inference_server"
    assert response.headers["retry-after"] == "5"
    _assert_nothing_recorded()  # the one-turn session opened for it is gone again


def test_a_dead_server_is_taken_out_and_the_request_retried_on_another(
    make_gateway, project, api_key, engine
):
    dead = _dead_url()
    gw = make_gateway(project, api_key, servers=[dead, engine.url])
    client = gw.openai()

    first = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=2)

    assert Interaction.objects.get(pk=first.id).server_url == engine.url
    down = InferenceServer.objects.get(url=dead)
    assert (down.healthy, down.failures) == (False, 1) and down.unhealthy_until is not None
    # Out of rotation while it backs off: the next request does not try it again.
    second = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert Interaction.objects.get(pk=second.id).server_url == engine.url
    assert InferenceServer.objects.get(url=dead).failures == 1
    assert InferenceServer.objects.get(url=engine.url).healthy


def test_a_server_answering_500_fails_over_too(make_gateway, project, api_key, engine, fake_engine):
    fake_engine.status = 500
    gw = make_gateway(project, api_key, servers=[fake_engine.url, engine.url])
    completion = gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert len(fake_engine.requests) == 1
    assert Interaction.objects.get(pk=completion.id).server_url == engine.url
    assert not InferenceServer.objects.get(url=fake_engine.url).healthy


def test_every_server_dead_is_503_and_records_nothing(make_gateway, project, api_key, openai_error):
    gw = make_gateway(project, api_key, servers=[_dead_url(), _dead_url()])
    response = gw.post("/chat/completions", {"messages": HI})
    assert openai_error(response, 503)["code"] == "inference_unavailable"
    assert response.headers["retry-after"] == "5"
    _assert_nothing_recorded()
    assert not InferenceServer.objects.filter(healthy=True).exists()


def test_a_session_sticks_to_its_server(make_gateway, project, api_key, engine, fake_engine):
    gw = make_gateway(project, api_key, servers=[fake_engine.url, engine.url])
    _, key = gw.start_session()
    client = gw.openai(key)
    messages: list = [*HI]
    first = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=2)
    assert Interaction.objects.get(pk=first.id).server_url == fake_engine.url
    # Now the engine comes first for new requests; the session stays where its prefix is cached.
    InferenceServer.objects.filter(url=engine.url).update(
        registered_at=InferenceServer.objects.get(url=fake_engine.url).registered_at
        - timedelta(seconds=1)
    )
    time.sleep(SERVERS_TTL_S)  # each gateway process re-reads a run's servers at most this often
    one_turn = gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert Interaction.objects.get(pk=one_turn.id).server_url == engine.url

    messages += [first.choices[0].message, {"role": "user", "content": "More"}]
    second = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=2)

    assert Interaction.objects.get(pk=second.id).server_url == fake_engine.url
    assert len(fake_engine.requests) == 2


def test_the_attach_command_registers_a_server_and_starts_serving(
    make_gateway, project, api_key, engine
):
    gw = make_gateway(project, api_key, servers=[], running=False)

    call_command("attach_inference_server", "--run", str(gw.run.id), "--url", engine.url + "/")

    gw.run.refresh_from_db()
    assert gw.run.status == "running"
    assert list(gw.run.servers.values_list("url", flat=True)) == [engine.url]
    completion = gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert Interaction.objects.get(pk=completion.id).server_url == engine.url


def test_a_generated_nul_is_returned_and_recorded_as_replacement_character(
    make_gateway, project, api_key, fake_engine
):
    # PostgreSQL text cannot hold NUL; a byte-level model can generate it.
    fake_engine.output_ids = [0, 104, 105, IM_END]
    gw = make_gateway(project, api_key, servers=[fake_engine.url])
    session_id, key = gw.start_session()
    client = gw.openai(key)
    first = client.chat.completions.create(model=gw.model, messages=HI, logprobs=True, max_tokens=4)
    assert first.choices[0].message.content == "\ufffdhi"
    assert first.choices[0].logprobs.content[0].bytes == [0]

    messages = [*HI, first.choices[0].message, {"role": "user", "content": "Again"}]
    client.chat.completions.create(model=gw.model, messages=messages, max_tokens=4)

    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")
    assert turn0.outputs[0]["output_ids"] == [0, 104, 105, IM_END]
    assert turn0.outputs[0]["text"] == "\ufffdhi"
    # The echoed answer still matches what was generated: the exact ids are reused.
    assert turn1.prefix_reused
    assert turn1.input_ids[: len(turn0.input_ids) + 4] == turn0.input_ids + [0, 104, 105, IM_END]


def test_a_lora_run_generates_under_its_current_versions_adapter(
    make_gateway, project, api_key, fake_engine
):
    gw = make_gateway(project, api_key, servers=[fake_engine.url], lora_rank=8)
    client = gw.openai()
    client.chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert "lora_path" not in fake_engine.requests[-1]  # version 0: the base model
    Run.objects.filter(pk=gw.run.pk).update(weight_version=3)
    # Admission allows (max_staleness + version + 1) batches: plenty at version 3.
    reply = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert fake_engine.requests[-1]["lora_path"] == f"{gw.run.pk}-v3"
    # The fake server reports weight version 0; tokens carry the adapter's version.
    assert reply.system_fingerprint == "steep-v3"
