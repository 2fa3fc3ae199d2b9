"""Token-exact prompts across turns (``webapp.gateway.prompts``), on the tiny model's template."""

from __future__ import annotations

from webapp.gateway.prompts import PreviousTurn, build_prompt

SYSTEM = {"role": "system", "content": "Answer briefly."}


def turn(tok, messages, previous, answer_text: str):
    prompt = build_prompt(tok, messages, None, previous)
    output_ids = tok.encode(answer_text)
    answer = {"role": "assistant", "content": tok.decode(output_ids)}
    return (
        prompt,
        PreviousTurn(
            messages=list(messages),
            tools=None,
            input_ids=prompt.input_ids,
            choices=[{"output_ids": output_ids, "message": answer}],
        ),
        answer,
    )


def test_each_turn_extends_the_exact_tokens_of_the_last_and_reads_as_the_template(chat_tokenizer):
    tok = chat_tokenizer
    messages = [SYSTEM, {"role": "user", "content": "2+2?"}]
    prompt, previous, answer = turn(tok, messages, None, "4")
    assert not prompt.reused
    for number in range(3):
        messages = [*messages, answer, {"role": "user", "content": f"And {number}+1?"}]
        prompt, next_previous, answer = turn(tok, messages, previous, str(number + 1))
        assert prompt.reused and prompt.chosen == 0
        seen = previous.input_ids + previous.choices[0]["output_ids"]
        assert prompt.input_ids[: len(seen)] == seen
        assert tok.decode(prompt.input_ids, skip_special_tokens=False) == tok.render(messages)
        previous = next_previous


def test_a_turn_renders_the_template_once(chat_tokenizer, monkeypatch):
    tok = chat_tokenizer
    messages = [SYSTEM, {"role": "user", "content": "2+2?"}]
    _, previous, answer = turn(tok, messages, None, "4")
    renders = []
    render = type(tok).render
    monkeypatch.setattr(
        type(tok), "render", lambda self, *a, **k: renders.append(1) or render(self, *a, **k)
    )
    prompt = build_prompt(
        tok, [*messages, answer, {"role": "user", "content": "More?"}], None, previous
    )
    assert prompt.reused and len(renders) == 1


def test_an_answer_the_template_writes_differently_is_rendered_afresh(chat_tokenizer):
    tok = chat_tokenizer
    messages = [SYSTEM, {"role": "user", "content": "2+2?"}]
    _, previous, _ = turn(tok, messages, None, "4")
    # The agent echoes the answer, but the generated ids were not what the template writes.
    previous.choices[0]["output_ids"] = tok.encode("four")
    previous.choices[0]["message"] = {"role": "assistant", "content": "4"}
    next_messages = [
        *messages,
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Sure?"},
    ]
    prompt = build_prompt(tok, next_messages, None, previous)
    assert not prompt.reused and prompt.chosen == 0
    assert prompt.input_ids == tok.encode(tok.render(next_messages))
