"""The OpenAI Agents SDK (an optional test dependency in its own environment: ``./steep install
--agents``) runs a tool-calling agent through the gateway on a chat template without tool
support: the model's ``<tool_call>`` comes back to the SDK as a tool call, the SDK runs the tool
and calls the model again, and the recorded tokens hold the call and the result as rendered,
on top of the first turn's exact tokens (issue 36)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rl_core.chat import ChatTokenizer, tool_call_text
from tests.gateway.test_tool_calls import TOOL_CALL_TEXT, TOOL_RESULT, tuned_to_answer
from tests.gateway.test_tools_on_any_template import NO_TOOLS, with_template
from webapp.gateway.models import Interaction

ROOT = Path(__file__).resolve().parents[2]
AGENTS_PYTHON = ROOT / ".venv-agents" / "bin" / "python"
AGENT = Path(__file__).with_name("agents_sdk_agent.py")

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not AGENTS_PYTHON.exists(),
        reason="the OpenAI Agents SDK is an optional test dependency: ./steep install --agents",
    ),
]


def _run_agent(base_url: str, key: str, model: str, max_turns: int) -> dict:
    done = subprocess.run(
        [str(AGENTS_PYTHON), str(AGENT), base_url, key, model, str(max_turns)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_agents_sdk_agent_calls_a_tool_through_the_gateway(
    engine, load_weights, make_gateway, project, api_key, tiny_model_dir, tmp_path
):
    no_tools = with_template(tiny_model_dir, tmp_path / "no-tools", NO_TOOLS)
    gw = make_gateway(project, api_key, model_dir=no_tools)
    # The SDK's first request as the model sees it (its tool schema carries "strict": false):
    # recorded once against the untuned model, then a copy is tuned to answer it with a call.
    session_id, key = gw.start_session()
    _run_agent(gw.base_url, key, gw.model, 1)
    [first] = Interaction.objects.filter(session_id=session_id)
    tuned = tmp_path / "tuned"
    shutil.copytree(no_tools, tuned)
    tuned_to_answer(tuned, first.input_ids, TOOL_CALL_TEXT)
    load_weights(engine, tuned, 0)
    try:
        session_id, key = gw.start_session()
        outcome = _run_agent(gw.base_url, key, gw.model, 2)
    finally:
        load_weights(engine, tiny_model_dir, 0)

    assert outcome["calls"][0] == {"city": "Paris"}  # the generated call ran as the SDK's tool
    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")[:2]
    assert turn0.input_ids == first.input_ids
    assert turn0.response["choices"][0]["finish_reason"] == "tool_calls"
    # The second call: the first turn's exact tokens (the call as generated), then the result.
    earlier = turn0.input_ids + turn0.outputs[0]["output_ids"]
    assert turn1.prefix_reused and turn1.input_ids[: len(earlier)] == earlier
    tok = ChatTokenizer.from_pretrained(no_tools)
    prompt = tok.decode(turn1.input_ids, skip_special_tokens=False)
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert (
        f"{tool_call_text(call)}<|im_end|>\n<|im_start|>tool\n{TOOL_RESULT}<|im_end|>\n" in prompt
    )
    assert turn1.messages[-1]["role"] == "tool" and turn1.messages[-1]["content"] == TOOL_RESULT
