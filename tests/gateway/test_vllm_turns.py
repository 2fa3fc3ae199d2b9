"""Agents' turns through the gateway served by a real vLLM (its CPU build), with the openai SDK.

What is recorded is vLLM's own: the token ids it sampled, their logprobs (checked against a
plain transformers forward pass at the turn's temperature) and the weight version it reports
for each token, also across a version change in the middle of a stream. A tool call comes
back as OpenAI tool_calls; a client that leaves a stream aborts vLLM's request. Needs
``./steep install --vllm``; CI sets ``STEEP_VLLM_CHECK=required`` so that it cannot skip there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rl_core.inference.vllm import VLLMClient, VLLMServer, vllm_available, vllm_python
from tests.gateway.test_tool_calls import TOOL_MESSAGES, TOOLS, tool_tuned
from webapp.gateway.models import Interaction

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

if not vllm_available():
    import os

    if os.environ.get("STEEP_VLLM_CHECK") == "required":
        raise RuntimeError(f"vLLM is not installed at {vllm_python()}: ./steep install --vllm")
    pytest.skip(f"vLLM is not installed at {vllm_python()}", allow_module_level=True)

VERSION = 3  # what the server reports from the start: a version 0 would prove nothing
TOLERANCE = 2e-3  # float32 on both sides; vLLM's CPU kernels sum in another order
STORY = [{"role": "user", "content": "Tell me a long story."}]
# tokens: a stream that runs while the test acts on it. 600 and then 1,500 were too few: the
# tiny model on vLLM writes ~900 tokens a second, and on a loaded machine vLLM's API server
# sent the first event 1.7 s after the request, when the engine had written them all (both
# vLLM tests below failed that way). 4,000 (~4.5 s) is within the gateway's max_tokens cap.
LONG = 4000


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model at a head size vLLM's CPU attention supports (32), tuned to call a tool."""
    from rl_core.tiny import build_tiny_model

    root = tmp_path_factory.getbasetemp()
    base = build_tiny_model(
        root / "tiny-vllm-8k", hidden=64, heads=2, kv_heads=1, max_positions=LONG + 512
    )
    return tool_tuned(base, root / "tiny-vllm-8k-tools")


@contextlib.contextmanager
def vllm_serving(
    model: Path, logs: Path, version: int, max_model_len: int = 2048
) -> Iterator[VLLMServer]:
    """A vLLM server of ``model`` (float32, one thread) reporting weight version ``version``."""
    server = VLLMServer(
        model,
        dtype="float32",
        max_model_len=max_model_len,
        kv_cache_space_gb=1,
        log_path=logs / "vllm.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    server.start()
    try:
        server.wait_healthy(timeout=900)  # a real model on busy cores: vLLM compiles it
        httpx.post(
            server.url + "/update_weight_version", json={"new_version": str(version)}, timeout=30
        ).raise_for_status()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    logs = tmp_path_factory.mktemp("vllm-gateway")
    with vllm_serving(vllm_model, logs, VERSION, max_model_len=LONG + 512) as server:
        yield server


@pytest.fixture
def vgw(make_gateway, project, api_key, vllm, vllm_model):
    return make_gateway(
        project, api_key, servers=[vllm.url], backend="vllm", model_dir=vllm_model, name="vllm"
    )


def reference_logprobs(model_dir: Path, turn: Interaction) -> torch.Tensor:
    from tests.rl_core.conftest import Reference

    output = turn.outputs[0]["output_ids"]
    return Reference().logprobs(model_dir, turn.input_ids, output, turn.temperature or 1.0)


def engine_metric(server: Any, name: str) -> float:
    """A vLLM Prometheus metric (its samples summed over their labels)."""
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(
        float(x) for x in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M)
    )


def test_a_chat_turn_records_vllms_tokens_logprobs_and_versions(vgw, vllm_model):
    _, key = vgw.start_session()
    reply = vgw.openai(key).chat.completions.create(
        model=vgw.model, messages=STORY, max_tokens=24, temperature=0.8, logprobs=True, seed=3
    )
    turn = Interaction.objects.get(pk=reply.id)
    out = turn.outputs[0]
    assert reply.system_fingerprint == f"steep-v{VERSION}"
    assert len(out["output_ids"]) == len(out["logprobs"]) == len(out["versions"]) > 0
    assert set(out["versions"]) == {VERSION}
    assert turn.server_url == vgw.run.servers.get().url
    # Logprobs of the distribution sampled (temperature 0.8), as the trainer recomputes them.
    torch.testing.assert_close(
        torch.tensor(out["logprobs"]), reference_logprobs(vllm_model, turn), atol=TOLERANCE, rtol=0
    )
    sent = [entry.logprob for entry in reply.choices[0].logprobs.content]
    assert len(sent) <= len(out["logprobs"])  # the end-of-turn token is recorded, not sent


def test_a_stream_across_a_version_change_records_each_tokens_version(vgw, vllm):
    _, key = vgw.start_session()
    generated = engine_metric(vllm, "vllm:generation_tokens_total")
    read: dict[str, Any] = {}

    def client() -> None:  # the agent reads its stream to the end
        stream = vgw.openai(key).chat.completions.create(
            model=vgw.model,
            messages=STORY,
            max_tokens=LONG,
            temperature=1.0,
            stream=True,
            extra_body={"min_tokens": LONG},  # it runs its length, whatever the model samples
        )
        chunks = list(stream)
        read["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        read["id"] = chunks[-1].id

    async def bump() -> None:
        async with VLLMClient(vllm.url) as engine:
            await engine.pause_generation("in_place")
            await engine.update_weight_version(VERSION + 1)
            await engine.continue_generation()

    agent = threading.Thread(target=client)
    agent.start()
    try:
        # Once vLLM has written some of the answer (what it counts, not what the client has
        # read: the gateway may hold text back), the rest is another version's.
        deadline = time.monotonic() + 120  # a bound on the wait, not a measure of speed
        while (
            engine_metric(vllm, "vllm:generation_tokens_total") - generated < 50
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        asyncio.run(bump())
        agent.join(300)
    finally:
        asyncio.run(_set_version(vllm.url, VERSION))
    turn = Interaction.objects.get(pk=read["id"])
    versions = turn.outputs[0]["versions"]
    assert turn.outputs[0]["finish_reason"] == "length"
    assert len(versions) == len(turn.outputs[0]["output_ids"]) == LONG
    assert versions[0] == VERSION and versions[-1] == VERSION + 1
    assert versions == sorted(versions)
    assert read["text"] == turn.outputs[0]["text"]


async def _set_version(url: str, version: int) -> None:
    async with VLLMClient(url) as client:
        await client.update_weight_version(version)


def test_a_tool_call_from_vllm_comes_back_as_tool_calls_and_is_recorded(vgw):
    _, key = vgw.start_session()
    reply = vgw.openai(key).chat.completions.create(
        model=vgw.model, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0, max_tokens=120
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    turn = Interaction.objects.get(pk=reply.id)
    assert set(turn.outputs[0]["versions"]) == {VERSION}


def test_a_client_that_leaves_a_stream_aborts_vllms_request(vgw, vllm, http):
    _, key = vgw.start_session()
    generated = engine_metric(vllm, "vllm:generation_tokens_total")
    body = {
        "model": vgw.model,
        "messages": STORY,
        "max_tokens": LONG,
        "min_tokens": LONG,
        "temperature": 1.0,
        "stream": True,
    }
    with http.stream(
        "POST",
        vgw.base_url + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as response:
        assert response.status_code == 200
        interaction_id = json.loads(next(line for line in response.iter_lines() if line)[6:])["id"]
    deadline = time.monotonic() + 120  # a bound on the wait, not a measure of speed
    while (
        not Interaction.objects.filter(pk=interaction_id).exists() and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    while engine_metric(vllm, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    # min_tokens holds the answer to LONG tokens: vLLM stopped short only if it was aborted.
    assert engine_metric(vllm, "vllm:generation_tokens_total") - generated < LONG
    turn = Interaction.objects.get(pk=interaction_id)
    assert turn.aborted and turn.outputs[0]["finish_reason"] == "abort"
    assert len(turn.outputs[0]["output_ids"]) < LONG
