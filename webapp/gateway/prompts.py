"""A turn's prompt: its token ids, exact across the turns of a session.

``turn_prompt`` is the chat path's prompt step. Within a session, when the new messages are the
previous turn's messages plus the answer Steep returned plus new messages, the prompt is the
previous turn's exact token stream (prompt + generated ids) followed by the rendering of only
the new part. The trajectory is then the literal stream the model saw and produced, and a turn
costs O(new tokens) to tokenize and, for a template whose rendering is local (most are:
``ChatTokenizer.renders_locally``), to render: the new part is rendered after a short stand-in
for the conversation, not after the conversation itself. When the messages do not extend the
last turn but an earlier one (a sub-agent's branch, or a fork; ``webapp.gateway.branches``),
that turn's tokens are reused the same way (``earlier_turns.branch_parent`` finds it).
Otherwise the messages are rendered afresh and the interaction records ``prefix_reused=False``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_core.chat import ChatTemplateError, ChatTokenizer, load_chat_tokenizer
from webapp.gateway import earlier_turns
from webapp.gateway.caches import CACHES
from webapp.gateway.chat_request import ChatRequest, PreviousTurn, continued_choice
from webapp.gateway.deltas import Prefix
from webapp.gateway.errors import GatewayError, bad_request
from webapp.gateway.replies import storable_text

if TYPE_CHECKING:
    from webapp.gateway.turns import Turn


@dataclass
class Prompt:
    input_ids: list[int]
    reused: bool
    chosen: int | None = None  # which choice of the previous turn the conversation continued with
    prefix: Prefix | None = None  # the turn it continues, for storing only what it added
    # Which of the session's last turn's choices the conversation continued with (``turn_prompt``;
    # None for a branch, whose trajectory building reads it off the messages).
    previous_chosen: int | None = None


async def tokenizer(base_model: str) -> ChatTokenizer:
    """A base model's chat tokenizer, loaded once per process (a 503 when it cannot be)."""
    tok = CACHES.tokenizers.get(base_model)
    if tok is None:
        try:  # the first load reads files: off the event loop
            tok = await asyncio.to_thread(load_chat_tokenizer, base_model)
        except (OSError, ValueError) as exc:
            raise GatewayError(
                503,
                f"Cannot load the tokenizer of {base_model}: {exc}",
                code="tokenizer_unavailable",
            ) from None
        CACHES.tokenizers[base_model] = tok
    return tok


async def turn_prompt(
    chat: ChatRequest, turn: Turn, db, interaction_id: str
) -> tuple[ChatTokenizer, Prompt]:
    """The run's tokenizer and the prompt of a turn: the last turn's exact tokens continued, or,
    for a request that does not continue the last turn, those of the earlier turn it branches
    from (``db`` runs the lookup), or a fresh render; a 400 when the template cannot render the
    messages. The common path, continuing the last turn, costs no extra statement.
    ``interaction_id`` names the prompt, whose text a turn continuing this one may then reuse
    (``extend_prompt``)."""
    tok = await tokenizer(turn.run.base_model)
    return tok, await _prompt(tok, chat, turn, db, interaction_id)


async def _prompt(
    tok: ChatTokenizer, chat: ChatRequest, turn: Turn, db, interaction_id: str
) -> Prompt:
    last, messages, tools = turn.previous, chat.messages, chat.rendered_tools
    try:
        if last is not None:
            extended = extend_prompt(tok, messages, tools, last, interaction_id)
            if extended is not None:
                extended.previous_chosen = extended.chosen
                return extended
            if turn.caller.session_turns > 1:
                parent = await db(
                    earlier_turns.branch_parent(
                        session_id=turn.session_id,
                        last_turn=turn.caller.session_turns - 1,
                        messages=messages,
                        tools=tools,
                    ),
                    durable=False,
                )
                if parent is not None:
                    branched = extend_prompt(tok, messages, tools, parent, interaction_id)
                    if branched is not None:
                        return branched
        fresh = fresh_prompt(tok, messages, tools)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    if last is not None:
        fresh.previous_chosen = continued_choice(messages, last)
    return fresh


def build_prompt(
    tok: ChatTokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    previous: PreviousTurn | None,
    key: str | None = None,
) -> Prompt:
    if previous is not None:
        extended = extend_prompt(tok, messages, tools, previous, key)
        if extended is not None:
            return extended
    return fresh_prompt(tok, messages, tools)


def fresh_prompt(tok: ChatTokenizer, messages: list[dict], tools: list[dict] | None) -> Prompt:
    """The messages rendered from scratch."""
    return Prompt(input_ids=tok.encode_messages(messages, tools), reused=False)


def extend_prompt(
    tok: ChatTokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    previous: PreviousTurn,
    key: str | None = None,
) -> Prompt | None:
    """None when ``messages`` do not continue ``previous``; else the previous turn's ids and the chosen answer's ids, then the tokens of what the
    template writes after them; a fresh render when its text does not begin with theirs.

    One render per turn: the previous prompt and the answer are taken as the text their ids
    decode to, not rendered again. The prompt's text is then the template's rendering of
    ``messages`` (up to what ``storable_text`` replaces), and its prefix is what the model
    saw and produced. That text of the previous prompt is, where this process built it,
    remembered under the previous turn's ``key``, so a turn decodes only the answer and the
    new tokens (``ChatTokenizer.decode_continued``); ``key`` names the prompt made here.
    """
    if (tools or None) != (previous.tools or None):
        return None
    chosen = continued_choice(messages, previous)
    if chosen is None:
        return None
    output_ids = list(previous.choices[chosen]["output_ids"])
    # The previous prompt's text, where it splits from the answer's: remembered, or decoded
    # once by a byte-level tokenizer (any other decodes prompt and answer together, below).
    prompt_text = tok.remembered(previous.key, len(previous.input_ids))
    if prompt_text is None and tok.byte_level:
        prompt_text = tok.decode(previous.input_ids, skip_special_tokens=False)
    added = None
    if prompt_text is not None and tok.joins(prompt_text):
        decoded = prompt_text + tok.decode(output_ids, skip_special_tokens=False)
        added = _added_by_tail(tok, messages, tools, previous, decoded[len(prompt_text) :])
    else:
        decoded = tok.decode(previous.input_ids + output_ids, skip_special_tokens=False)
    if added is None:
        # As stored and returned: a generated NUL reads as U+FFFD in the answer the agent echoes.
        seen = storable_text(decoded)
        full = tok.render(messages, tools=tools, add_generation_prompt=True)
        if not full.startswith(seen) and tok.special_ids.intersection(output_ids):
            seen = storable_text(shown_text(tok, previous, output_ids, full))
        if not full.startswith(seen):
            return Prompt(input_ids=tok.encode(full), reused=False, chosen=chosen)
        added = tok.encode(full[len(seen) :])
    input_ids = previous.input_ids + output_ids + added
    if key is not None and tok.joins(decoded):
        text = decoded + tok.decode(added, skip_special_tokens=False)
        tok.remember_text(key, len(input_ids), text)
    prefix = None
    if previous.turn is not None:
        prefix = Prefix(
            previous.turn, chosen, len(previous.messages), len(previous.input_ids) + len(output_ids)
        )
    return Prompt(input_ids=input_ids, reused=True, chosen=chosen, prefix=prefix)


def _added_by_tail(
    tok: ChatTokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    previous: PreviousTurn,
    answer: str,
) -> list[int] | None:
    """The ids of what the template writes after the previous prompt and the ``answer`` text,
    from a rendering of a stand-in for the earlier conversation and what this turn added
    (``ChatTokenizer.render_tail``): the work of a turn does not grow with the session. The
    earlier messages were compared with the previous turn's by what reaches the model
    (``continued_choice``); the answer must render as the model wrote it. None where this
    cannot be used (a template whose rendering is not local, an answer echoed otherwise): the
    caller renders the whole conversation and checks it."""
    tail = tok.render_tail(previous.messages, messages[len(previous.messages) :], tools)
    if tail is None:
        return None
    head, text = tail
    seen = storable_text(head + answer)
    if not text.startswith(seen):
        return None
    return tok.encode(text[len(seen) :])


def shown_text(tok: ChatTokenizer, previous: PreviousTurn, output_ids: list[int], full: str) -> str:
    """The previous prompt's text and the answer's as the agent saw it, for ``full`` to begin with.

    A special token the model generated is in the reply only where the rendering writes it
    too (the end of turn it stopped at); anywhere else the reply left it out, as SGLang
    skips special tokens, so the agent's echo renders without it. It is left out of this
    text, not out of the ids: the next prompt holds what the model produced.
    """
    text = tok.decode_continued(previous.key, previous.input_ids, [])
    run: list[int] = []
    for token in [*output_ids, None]:
        if token is not None and token not in tok.special_ids:
            run.append(token)
            continue
        text += tok.decode(run, skip_special_tokens=False)
        run = []
        if token is not None and full.startswith(piece := tok.token_text(token), len(text)):
            text += piece
    return text
