"""Token-exact prompts across turns (``webapp.gateway.prompts``), on the tiny model's template."""

from __future__ import annotations

import random

import pytest

from rl_core.chat import ChatTokenizer
from webapp.gateway.chat_request import PreviousTurn
from webapp.gateway.prompts import build_prompt

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


def test_a_turn_renders_what_it_added_not_the_conversation(chat_tokenizer, monkeypatch):
    """Issue 36: at turn k the template renders a stand-in of at most three messages plus
    what the turn added, twice, whatever k is; the tokens equal a whole rendering's."""
    tok = chat_tokenizer
    assert tok.renders_locally()
    messages = [SYSTEM, {"role": "user", "content": "2+2?"}]
    _, previous, answer = turn(tok, messages, None, "4")
    for number in range(40):
        messages = [*messages, answer, {"role": "user", "content": f"And {number}?"}]
        _, previous, answer = turn(tok, messages, previous, str(number))
    rendered: list[int] = []
    render = type(tok).render
    monkeypatch.setattr(
        type(tok),
        "render",
        lambda self, msgs, **k: rendered.append(len(msgs)) or render(self, msgs, **k),
    )
    messages = [*messages, answer, {"role": "user", "content": "More?"}]
    prompt = build_prompt(tok, messages, None, previous)
    assert prompt.reused and len(messages) == 84
    assert rendered == [2, 4]  # the stand-in (first, last), then with the answer and question
    monkeypatch.undo()
    assert tok.decode(prompt.input_ids, skip_special_tokens=False) == tok.render(messages)


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


@pytest.mark.parametrize(
    "answer",
    [
        ["ab", "<|pad|>", "c"],  # inside the answer
        ["ab", "<|im_start|>", "<|pad|>", "c", "<|im_end|>"],  # two, then the stop token
        ["abc", "<|pad|>"],  # the last token of an answer cut at max_tokens
        ["<|pad|>", "abc"],  # the first
    ],
)
def test_special_tokens_the_reply_left_out_stay_in_the_ids(chat_tokenizer, answer):
    """A special token the model generated that the reply skipped (the engine decodes with
    skip_special_tokens) is not in the agent's echo: the prompt still continues the
    exact ids, and reads as the template's rendering plus what the model produced."""
    tok = chat_tokenizer
    messages = [SYSTEM, {"role": "user", "content": "2+2?"}]
    prompt, previous, _ = turn(tok, messages, None, "")
    output_ids = [i for piece in answer for i in tok.encode(piece)]
    assert tok.special_ids.intersection(output_ids)
    shown = {"role": "assistant", "content": tok.decode(output_ids)}
    assert shown["content"] == "abc"
    previous.choices[0] = {"output_ids": output_ids, "message": shown}
    next_messages = [*messages, shown, {"role": "user", "content": "Sure?"}]

    extended = build_prompt(tok, next_messages, None, previous)

    assert extended.reused and extended.chosen == 0
    seen = prompt.input_ids + output_ids
    assert extended.input_ids[: len(seen)] == seen
    rendered = tok.render(next_messages)
    rest = tok.decode(extended.input_ids[len(seen) :], skip_special_tokens=False)
    assert rendered.endswith(rest) and rest.startswith(
        "\n" if answer[-1] == "<|im_end|>" else "<|im_end|>"
    )


class _DecodeSpy:
    """The tokenizer, with the lengths of the id lists it decodes written down."""

    def __init__(self, tokenizer):
        self._tokenizer, self.lengths = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _conversation(tok, answers: list[list[int]], keyed: bool):
    """Prompts of a session whose answers are ``answers`` (ids), each turn built from the last
    as the gateway does: with the turn's interaction id as ``key`` when ``keyed``."""
    messages = [SYSTEM, {"role": "user", "content": "2+2?"}]
    previous, prompts = None, []
    for number, output_ids in enumerate(answers):
        key = f"chatcmpl-{number}-{keyed}" if keyed else None
        prompt = build_prompt(tok, messages, None, previous, key)
        prompts.append(prompt)
        answer = {"role": "assistant", "content": tok.decode(output_ids)}
        previous = PreviousTurn(
            messages=list(messages),
            tools=None,
            input_ids=prompt.input_ids,
            choices=[{"output_ids": output_ids, "message": answer}],
            key=key,
        )
        messages = [*messages, answer, {"role": "user", "content": f"And {number}€?"}]
    return prompts


def test_a_continued_turn_decodes_its_answer_and_new_tokens_not_the_conversation(
    chat_tokenizer, monkeypatch
):
    tok = chat_tokenizer
    answers = [tok.encode(text) for text in ("4", "Ça fait 5 😀.", "6", "7!")]
    spy = _DecodeSpy(tok.tokenizer)
    monkeypatch.setattr(tok, "tokenizer", spy)
    prompts = _conversation(tok, answers, keyed=True)
    monkeypatch.undo()
    assert all(p.reused for p in prompts[1:])
    # From the third turn on, the previous prompt's text is remembered: no decode is as long.
    assert max(spy.lengths[-4:]) < len(prompts[1].input_ids)
    assert [p.input_ids for p in prompts] == [
        p.input_ids for p in _conversation(tok, answers, keyed=False)
    ]
    assert tok.decode(prompts[-1].input_ids, skip_special_tokens=False).endswith(
        "And 2€?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_an_answer_cut_inside_a_character_is_decoded_with_the_whole_conversation(chat_tokenizer):
    tok = chat_tokenizer
    emoji = list("😀".encode())  # the tiny model's ids are bytes
    # An answer cut after two of the emoji's four bytes, then one ending on a whole character.
    answers = [tok.encode("4"), emoji[:2], emoji, tok.encode("é")]
    keyed = _conversation(tok, answers, keyed=True)
    assert [p.input_ids for p in keyed] == [
        p.input_ids for p in _conversation(tok, answers, keyed=False)
    ]


def test_decode_continued_equals_decoding_the_whole_ids(tiny_model_dir):
    tok = ChatTokenizer.from_pretrained(tiny_model_dir)  # its own remembered texts
    rng = random.Random(11)
    specials = [tok.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>")]
    pieces = [*range(32, 127), *list("é😀€".encode()), 0, 0xE2, 0x82, 0xFF, *specials]
    for case in range(300):
        ids = [rng.choice(pieces) for _ in range(rng.randrange(0, 12))]
        more = [rng.choice(pieces) for _ in range(rng.randrange(0, 12))]
        key = f"case-{case}"
        tok.remember_text(key, len(ids), tok.decode(ids, skip_special_tokens=False))
        whole = tok.decode(ids + more, skip_special_tokens=False)
        assert tok.decode_continued(key, ids, more) == whole
        assert tok.decode_continued(None, ids, more) == whole
        if tok.joins(tok.decode(ids, skip_special_tokens=False)):
            assert whole == tok.decode(ids, skip_special_tokens=False) + tok.decode(
                more, skip_special_tokens=False
            )


def test_remembered_texts_are_bounded_and_only_byte_level_decoders_join(
    tiny_model_dir, monkeypatch
):
    tok = ChatTokenizer.from_pretrained(tiny_model_dir)
    assert tok.byte_level
    monkeypatch.setattr(type(tok), "TEXT_CACHE_CHARS", 10)
    tok.remember_text("a", 1, "12345")
    tok.remember_text("b", 1, "67890")
    tok.remember_text("c", 1, "x")
    assert "a" not in tok._texts and list(tok._texts) == ["b", "c"]
    assert tok.decode_continued("a", [ord("z")], [ord("!")]) == "z!"  # forgotten: decoded whole
    assert tok.decode_continued("c", [ord("z")], [ord("!")]) == "x!"  # remembered (as told)
    assert tok.decode_continued("c", [1, 2], [ord("!")]) != "x!"  # not for other ids
    monkeypatch.setattr(tok, "byte_level", False)
    assert not tok.joins("plain ASCII")
