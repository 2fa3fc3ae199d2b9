"""A session's turn renders only what it added (issue 36): after a three-message stand-in of the
conversation, for templates whose rendering is local (a probe finds which), and the whole
conversation for the others; either way the prompt is the template's rendering."""

from __future__ import annotations

import pytest

from rl_core.chat import ChatTokenizer, stand_in
from tests.gateway.test_tools_on_any_template import NO_TOOLS, with_template
from webapp.gateway.chat_request import PreviousTurn
from webapp.gateway.prompts import build_prompt

# Llama 2's shape: the system prompt folded into the first user turn, roles checked to
# alternate by position (a message's index parity), the BOS before every user turn.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set offset = 1 %}{% set system = messages[0]['content'] %}"
    "{% else %}{% set offset = 0 %}{% set system = '' %}{% endif %}"
    "{% for message in messages[offset:] %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '<s>[INST] ' }}{% if loop.first and system %}"
    "{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{% endif %}{{ message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' </s>' }}{% endif %}{% endfor %}"
)
# A template that numbers the turns: a message's text depends on how many came before it.
NUMBERED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' #' + loop.index|string"
    " + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant #' + (messages|length + 1)|string"
    " + '\\n' }}{% endif %}"
)


def test_the_stand_in_keeps_the_first_message_and_each_position_s_parity():
    for n in range(1, 12):
        messages = list(range(n))
        short = stand_in(messages)
        assert short[0] == 0 and short[-1] == n - 1 and len(short) <= 3
        assert len(short) % 2 == n % 2  # the last message keeps its position's parity
        if n > 3:
            assert short[-2:] == messages[-2:] if n % 2 else short[-1:] == messages[-1:]


@pytest.mark.parametrize(
    ("name", "template", "local"),
    [("own", None, True), ("no-tools", NO_TOOLS, True), ("llama2", LLAMA2, True),
     ("numbered", NUMBERED, False)],
)  # fmt: skip
def test_thirty_turns_render_as_the_whole_conversation_does(
    name, template, local, tiny_model_dir, tmp_path, monkeypatch
):
    path = (
        tiny_model_dir
        if template is None
        else with_template(tiny_model_dir, tmp_path / name, template)
    )
    tok = ChatTokenizer.from_pretrained(path)
    assert tok.renders_locally() is local
    # The answer as the template writes it after the prompt: what the model generated.
    written = (lambda a: f" {a} </s>") if name == "llama2" else (lambda a: a + "<|im_end|>")
    system = [] if name == "llama2" else [{"role": "system", "content": "Be brief."}]
    messages = [*system, {"role": "user", "content": "Hi there."}]
    previous = None
    longest: list[int] = []
    render = type(tok).render
    monkeypatch.setattr(
        type(tok),
        "render",
        lambda self, msgs, **k: longest.append(len(msgs)) or render(self, msgs, **k),
    )
    for turn in range(30):
        longest.clear()
        prompt = build_prompt(tok, messages, None, previous, key=f"t{turn}")
        assert tok.decode(prompt.input_ids, skip_special_tokens=False) == render(tok, messages)
        if turn:
            assert prompt.reused
            assert max(longest) <= (5 if local else len(messages))  # stand-in + answer + question
        answer = f"Answer {turn}."
        output_ids = tok.encode(written(answer))
        previous = PreviousTurn(
            messages=list(messages),
            tools=None,
            input_ids=prompt.input_ids,
            choices=[
                {"output_ids": output_ids, "message": {"role": "assistant", "content": answer}}
            ],
            key=f"t{turn}",
            turn=turn,
        )
        messages = [
            *messages,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Question {turn}?"},
        ]
