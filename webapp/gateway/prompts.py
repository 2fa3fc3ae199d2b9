"""Token-exact prompts across turns.

Within a session, when the new messages are the previous turn's messages plus the
answer Steep returned plus new messages, the prompt is the previous turn's exact
token stream (prompt + generated ids) followed by the rendering of only the new
part. The trajectory is then the literal stream the model saw and produced, and a
turn costs O(new tokens) to tokenize. Otherwise the messages are rendered afresh
and the interaction records ``prefix_reused=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_core.chat import ChatTokenizer
from webapp.gateway.requests import normalize_message, storable_text


@dataclass
class PreviousTurn:
    messages: list[dict]
    tools: list[dict] | None
    input_ids: list[int]
    choices: list[dict]  # per choice: {"output_ids": [...], "message": {...as returned}}


@dataclass
class Prompt:
    input_ids: list[int]
    reused: bool
    chosen: int | None = None  # which choice of the previous turn the conversation continued with


def build_prompt(
    tok: ChatTokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    previous: PreviousTurn | None,
) -> Prompt:
    if previous is not None:
        extended = _extend(tok, messages, tools, previous)
        if extended is not None:
            return extended
    return Prompt(input_ids=tok.encode_messages(messages, tools), reused=False)


def continued_choice(messages: list[dict], previous: PreviousTurn) -> int | None:
    """Index of the previous turn's choice that ``messages`` continue with, if they extend it."""
    k = len(previous.messages)
    if len(messages) <= k:
        return None
    if [normalize_message(m) for m in messages[:k]] != [
        normalize_message(m) for m in previous.messages
    ]:
        return None
    answer = normalize_message(messages[k])
    for index, choice in enumerate(previous.choices):
        if normalize_message(choice["message"]) == answer:
            return index
    return None


def _extend(
    tok: ChatTokenizer, messages: list[dict], tools: list[dict] | None, previous: PreviousTurn
) -> Prompt | None:
    if (tools or None) != (previous.tools or None):
        return None
    chosen = continued_choice(messages, previous)
    if chosen is None:
        return None
    k = len(previous.messages)
    previous_prompt = tok.render(previous.messages, tools=tools, add_generation_prompt=True)
    with_answer = tok.render(messages[: k + 1], tools=tools, add_generation_prompt=False)
    full = tok.render(messages, tools=tools, add_generation_prompt=True)
    if not (with_answer.startswith(previous_prompt) and full.startswith(with_answer)):
        return None
    # What the template writes for the answer, versus what the model generated: the
    # generated ids stay as they are; only the template's closing text is appended.
    answer_text = with_answer[len(previous_prompt) :]
    output_ids = previous.choices[chosen]["output_ids"]
    generated = storable_text(tok.decode(output_ids, skip_special_tokens=False))
    if not answer_text.startswith(generated):
        return Prompt(input_ids=tok.encode(full), reused=False, chosen=chosen)
    new_text = answer_text[len(generated) :] + full[len(with_answer) :]
    return Prompt(
        input_ids=previous.input_ids + list(output_ids) + tok.encode(new_text),
        reused=True,
        chosen=chosen,
    )
