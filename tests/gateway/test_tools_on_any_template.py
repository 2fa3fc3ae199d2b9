"""Tools on a chat template that has none (SmolLM2's, Llama 2's, Gemma's): content null renders
as empty text, and what the template ignores of tools, tool calls and tool results Steep writes
itself in the format its tool-call parser reads back. Through the gateway with the official
openai and anthropic SDKs (chat completions, Responses, Messages), the model fine-tuned to call
get_weather on such a template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rl_core.chat import (
    ChatTokenizer,
    ToolSupport,
    parse_tool_calls,
    tool_call_text,
    tools_text,
)
from tests.gateway import test_agent_api_tools as api_tools
from tests.gateway.test_tool_calls import TOOL_MESSAGES, TOOL_RESULT, TOOLS, tool_tuned
from webapp.gateway.models import Interaction

# SmolLM2-135M-Instruct's template without its default system line: every message as
# role + content (None fails: str + None), tools and tool calls ignored.
NO_TOOLS = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template that also drops tool messages (it renders three roles only).
THREE_ROLES = (
    "{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def with_template(base: Path, out: Path, template: str) -> Path:
    if not out.exists():
        shutil.copytree(base, out)
        (out / "chat_template.jinja").write_text(template)
    return out


@pytest.fixture(scope="module")
def no_tools_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return with_template(tiny_model_dir, tmp_path_factory.getbasetemp() / "no-tools", NO_TOOLS)


def test_probes_find_what_each_template_renders(tiny_model_dir, no_tools_dir, tmp_path):
    three = with_template(tiny_model_dir, tmp_path / "three-roles", THREE_ROLES)
    assert ChatTokenizer.from_pretrained(tiny_model_dir).tool_support() == ToolSupport(
        True, True, True
    )
    assert ChatTokenizer.from_pretrained(no_tools_dir).tool_support() == ToolSupport(
        False, False, True
    )
    assert ChatTokenizer.from_pretrained(three).tool_support() == ToolSupport(False, False, False)


def test_a_template_without_tools_gets_them_written_by_steep(
    tiny_model_dir, no_tools_dir, tmp_path
):
    tok = ChatTokenizer.from_pretrained(no_tools_dir)
    # The template alone fails on the null content an agent sends with a tool call.
    with pytest.raises(TypeError, match="NoneType"):
        tok.template.render(messages=[{"role": "assistant", "content": None}])
    messages = [
        {"role": "system", "content": "Be brief."},
        *TOOL_MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT},
    ]
    assert tok.render(messages, tools=TOOLS) == (
        f"<|im_start|>system\nBe brief.\n\n{tools_text(TOOLS)}<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>\n"
        f"<|im_start|>tool\n{TOOL_RESULT}<|im_end|>\n<|im_start|>assistant\n"
    )
    # What Steep writes of a call is what its parser reads back.
    content, [call] = parse_tool_calls(tool_call_text(CALL))
    assert content == "" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # No system message: one of Steep's own. A template that drops tool messages gets the
    # results as one user turn of <tool_response> blocks.
    three = ChatTokenizer.from_pretrained(
        with_template(tiny_model_dir, tmp_path / "t", THREE_ROLES)
    )
    two_results = [
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "clear"},
    ]
    text = three.render([*messages[1:3], *two_results], tools=TOOLS)
    assert text.startswith(f"<|im_start|>system\n{tools_text(TOOLS)}<|im_end|>\n")
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\nclear\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # A template with tool support renders them itself, as before; null content is "" there too.
    tiny = ChatTokenizer.from_pretrained(tiny_model_dir)
    assert tools_text(TOOLS) not in tiny.render(messages, tools=TOOLS)
    assert tiny.render([{"role": "user", "content": None}]) == tiny.render(
        [{"role": "user", "content": ""}]
    )


# --------------------------------------------------------------------------- through the gateway


@pytest.fixture(scope="module")
def no_tools_tuned(no_tools_dir, tmp_path_factory) -> Path:
    """The tiny model on the template without tools, fine-tuned to call get_weather when given
    TOOLS the way Steep writes them into the system message."""
    return tool_tuned(no_tools_dir, tmp_path_factory.getbasetemp() / "no-tools-tuned")


@pytest.fixture(scope="module")
def no_tools_weights(engine, load_weights, no_tools_tuned, tiny_model_dir):
    load_weights(engine, no_tools_tuned, 0)
    yield
    load_weights(engine, tiny_model_dir, 0)


@pytest.fixture
def gw(no_tools_weights, make_gateway, project, api_key, no_tools_tuned):
    return make_gateway(project, api_key, model_dir=no_tools_tuned)


def _recorded(session_id: str, model_dir: Path) -> tuple[Interaction, str]:
    """The conversation's second turn, its prompt's text; the first turn's exact tokens begin it."""
    tok = ChatTokenizer.from_pretrained(model_dir)
    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")
    earlier = turn0.input_ids + turn0.outputs[0]["output_ids"]
    assert turn1.prefix_reused and turn1.input_ids[: len(earlier)] == earlier
    prompt = tok.decode(turn1.input_ids, skip_special_tokens=False)
    assert tools_text(TOOLS) in prompt  # the schemas the model was shown
    assert f"{CALL_TEXT}<|im_end|>\n<|im_start|>tool\n{TOOL_RESULT}<|im_end|>\n" in prompt
    return turn1, prompt


@pytest.mark.django_db(transaction=True)
def test_openai_chat_tool_calls_round_trip_on_a_template_without_tools(gw, no_tools_tuned):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    messages: list = list(TOOL_MESSAGES)
    first = client.chat.completions.create(
        model=gw.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=120
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The SDK's message object goes back as it is (content null, tool_calls), then the result.
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    client.chat.completions.create(
        model=gw.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=8
    )
    _recorded(session_id, no_tools_tuned)


@pytest.mark.django_db(transaction=True)
def test_a_responses_function_call_round_trips_on_a_template_without_tools(gw, no_tools_tuned):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    first = client.responses.create(
        model=gw.model, input=TOOL_MESSAGES, tools=api_tools.RESPONSES_TOOLS, temperature=0,
        max_output_tokens=120,
    )  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    client.responses.create(
        model=gw.model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}],
        tools=api_tools.RESPONSES_TOOLS,
        temperature=0,
        max_output_tokens=8,
    )
    _recorded(session_id, no_tools_tuned)


@pytest.mark.django_db(transaction=True)
def test_an_anthropic_tool_use_round_trips_on_a_template_without_tools(gw, no_tools_tuned):
    session_id, key = gw.start_session()
    client = api_tools._anthropic(gw, key)
    first = client.messages.create(
        model=gw.model, max_tokens=120, messages=TOOL_MESSAGES, tools=api_tools.ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )  # fmt: skip
    [tool_use] = first.content
    assert first.stop_reason == "tool_use" and tool_use.input == {"city": "Paris"}
    client.messages.create(
        model=gw.model,
        max_tokens=8,
        messages=[
            *TOOL_MESSAGES,
            {"role": "assistant", "content": [tool_use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tool_use.id, "content": TOOL_RESULT}
                ],
            },
        ],
        tools=api_tools.ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )
    _recorded(session_id, no_tools_tuned)


@pytest.mark.django_db(transaction=True)
def test_a_streamed_tool_call_on_a_template_without_tools_arrives_as_deltas(gw):
    chunks = list(
        gw.openai().chat.completions.create(
            model=gw.model, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
            stream=True,
        )
    )  # fmt: skip
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
