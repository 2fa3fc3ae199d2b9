"""Tool calling round trip with a model fine-tuned to call get_weather: OpenAI tool_calls out,
a tool message back in, rendered into the next prompt on top of the exact earlier tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from webapp.gateway.models import Interaction

pytestmark = pytest.mark.django_db(transaction=True)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_CALL_TEXT = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
)
TOOL_RESULT = '{"temperature_c": 18, "sky": "clear"}'


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_tuned(tiny_model_dir, tmp_path_factory.getbasetemp() / "tiny-model-tools")


def tool_tuned(base: Path, out: Path) -> Path:
    """A copy of ``base`` (a tiny model) at ``out``, fine-tuned (SFT, AdamW on CPU) to answer
    TOOL_MESSAGES with TOOLS by TOOL_CALL_TEXT: a random model never emits a tool call by
    itself. Made once per test session (other modules import this)."""
    from rl_core.chat import ChatTokenizer

    if (out / "sft-done").exists():
        return out
    shutil.copytree(base, out)
    tok = ChatTokenizer.from_pretrained(out)
    return tuned_to_answer(out, tok.encode(tok.render(TOOL_MESSAGES, tools=TOOLS)), TOOL_CALL_TEXT)


def tuned_to_answer(out: Path, prompt: list[int], answer: str) -> Path:
    """The model at ``out`` fine-tuned in place to answer the token ids ``prompt`` by ``answer``."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_core.chat import ChatTokenizer

    tok = ChatTokenizer.from_pretrained(out)
    ids = torch.tensor([prompt + tok.encode(answer)])  # [1, T]
    labels = ids.clone()
    labels[0, : len(prompt)] = -100  # loss on the answer only
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(300):
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 5e-3:
                break
    assert loss.item() < 5e-3, f"the tool-call SFT did not converge (loss {loss.item():.4f})"
    model.eval().save_pretrained(out)
    (out / "sft-done").touch()
    return out


@pytest.fixture(scope="module")
def tool_weights(engine, load_weights, tool_model_dir, tiny_model_dir):
    """The shared engine serves the fine-tuned weights for this module only."""
    load_weights(engine, tool_model_dir, 0)
    yield
    load_weights(engine, tiny_model_dir, 0)


@pytest.fixture
def tools_gw(tool_weights, make_gateway, project, api_key, tool_model_dir):
    return make_gateway(project, api_key, model_dir=tool_model_dir)


def test_a_tool_call_round_trips_and_the_tool_result_extends_the_recorded_prompt(tools_gw):
    from rl_core.chat import load_chat_tokenizer

    tok = load_chat_tokenizer(str(tools_gw.model_dir))
    session_id, key = tools_gw.start_session()
    client = tools_gw.openai(key)
    messages: list = list(TOOL_MESSAGES)

    first = client.chat.completions.create(
        model=tools_gw.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=120
    )

    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # The agent sends the SDK's message object back as it is, then the tool's answer.
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    second = client.chat.completions.create(
        model=tools_gw.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=8
    )

    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")
    assert (turn0.id, turn1.id) == (first.id, second.id)
    assert turn1.prefix_reused
    earlier = turn0.input_ids + turn0.outputs[0]["output_ids"]
    assert turn1.input_ids[: len(earlier)] == earlier
    prompt = tok.decode(turn1.input_ids, skip_special_tokens=False)
    assert prompt.endswith(
        f"</tool_call><|im_end|>\n<|im_start|>tool\n{TOOL_RESULT}<|im_end|>\n<|im_start|>assistant\n"
    )
    # Re-rendering the whole conversation gives the same tokens: the template and the
    # generated call agree exactly, so nothing was lost by reusing the generated ids.
    assert turn1.input_ids == tok.encode(tok.render(_plain(messages), tools=TOOLS))


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(tools_gw):
    chunks = list(
        tools_gw.openai().chat.completions.create(
            model=tools_gw.model,
            messages=TOOL_MESSAGES,
            tools=TOOLS,
            temperature=0,
            max_tokens=120,
            stream=True,
        )
    )
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_hides_the_tools_from_the_model(tools_gw):
    from rl_core.chat import load_chat_tokenizer

    tok = load_chat_tokenizer(str(tools_gw.model_dir))
    completion = tools_gw.openai().chat.completions.create(
        model=tools_gw.model,
        messages=TOOL_MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=4,
    )
    assert completion.choices[0].message.tool_calls is None
    recorded = Interaction.objects.get(pk=completion.id)
    assert recorded.input_ids == tok.encode(tok.render(TOOL_MESSAGES))


def _plain(messages: list) -> list[dict]:
    return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]


def test_a_streamed_tool_call_with_logprobs_leaks_no_markup_and_no_stop_token(tools_gw):
    chunks = list(
        tools_gw.openai().chat.completions.create(
            model=tools_gw.model,
            messages=TOOL_MESSAGES,
            tools=TOOLS,
            temperature=0,
            max_tokens=120,
            logprobs=True,
            stream=True,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [
        item.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content
    ]
    # The answer is nothing but the call and <|im_end|>: no text, so no token to show.
    assert (content, tokens) == ("", [])
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    recorded = Interaction.objects.get(pk=chunks[0].id)
    assert recorded.outputs[0]["text"].startswith("<tool_call>")
    assert recorded.response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )


def test_a_streamed_replay_of_a_tool_call_with_logprobs_sends_no_markup_as_content(tools_gw):
    _, key = tools_gw.start_session()
    client = tools_gw.openai(key)
    body = {
        "model": tools_gw.model,
        "messages": TOOL_MESSAGES,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 120,
        "logprobs": True,
    }
    first = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True))  # the same request again
    assert {c.id for c in chunks} == {first.id}  # replayed, not generated again
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in content and "<|im_end|>" not in content
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
