"""A recorded session as the session page shows it: turns, new messages, version-coloured tokens.

Generated tokens carry the policy version that produced them; the page colours each version
from a colour-blind-safe palette (Okabe-Ito, classes ``.v0`` … ``.v7`` in steep.css). Prompt
tokens (what the model read) are shown apart, uncoloured.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from rl_core.chat import load_chat_tokenizer

logger = logging.getLogger(__name__)

PALETTE_SIZE = 8  # colours .v0 … .v7 in steep.css, reused past eight versions


@dataclass
class Token:
    id: int
    text: str
    version: int
    logprob: float
    colour: int


@dataclass
class PromptTokens:
    tokens: list[tuple[int, str]]  # (id, text) of the tokens this turn added to the prompt
    total: int  # the whole prompt's length


@dataclass
class Choice:
    index: int
    tokens: list[Token]
    text: str
    finish_reason: str | None


@dataclass
class Turn:
    interaction: object  # gateway.models.Interaction
    messages: list[dict]  # what the agent added this turn, ready to print
    full_history: bool  # every message as sent (first turn, or the agent rewrote its history)
    answer: Choice
    prompt: PromptTokens
    other_choices: list[Choice] = field(default_factory=list)


def token_decoder(base_model: str) -> Callable[[list[int]], list[str]] | None:
    """Token ids → the text of each token with the run's own tokenizer; None when it can't load here.

    A character split over several byte-level tokens decodes to "\ufffd" token by token; its
    first token then shows the whole character and the others show nothing.
    """
    try:
        tokenizer = load_chat_tokenizer(base_model)
    except Exception as exc:  # missing or unreadable model directory: the page shows ids instead
        logger.info("No tokenizer for %s on the session page: %s", base_model, exc)
        return None

    def text(ids: list[int]) -> str:
        try:
            if len(ids) == 1:
                return tokenizer.token_text(ids[0])
            return tokenizer.decode(ids, skip_special_tokens=False)
        except Exception:
            return "".join(f"[{i}]" for i in ids)

    def decode(ids: list[int]) -> list[str]:
        texts, i = [], 0
        while i < len(ids):
            piece, width = text([ids[i]]), 1
            if "\ufffd" in piece:
                for n in range(2, min(4, len(ids) - i) + 1):  # UTF-8: at most 4 bytes a character
                    joined = text(ids[i : i + n])
                    if "\ufffd" not in joined:
                        piece, width = joined, n
                        break
            texts += [piece] + [""] * (width - 1)
            i += width
        return texts

    return decode


def message_text(content) -> str:
    """A message's content as text: a string, or the text of its parts (others named)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type", "part") if isinstance(part, dict) else "part"
                parts.append(f"[{kind}]")
        return "\n".join(parts)
    return json.dumps(content)


def _printable(message: dict) -> dict:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append(f"{fn.get('name', '?')}({arguments})")
    return {
        "role": message.get("role", "?"),
        "name": message.get("name") or message.get("tool_call_id") or "",
        "text": message_text(message.get("content")),
        "tool_calls": calls,
    }


def new_messages(previous: list | None, messages: list) -> tuple[list, bool]:
    """What a turn added to the conversation, and whether that is the whole history.

    A turn normally resends the previous turn's messages plus that turn's answer,
    then adds its own: only those are new. An agent that rewrote its history
    (trimmed context, edited a message) gets every message shown as sent.
    """
    if previous is None:
        return messages, True
    n = len(previous)
    if len(messages) > n and messages[:n] == previous:
        added = messages[n:]
        if added and isinstance(added[0], dict) and added[0].get("role") == "assistant":
            added = added[1:]  # the previous answer, echoed back: shown as that turn's answer
        return added, False
    return messages, True


def _choice(index: int, output: dict, decode, colours: dict[int, int]) -> Choice:
    ids = output.get("output_ids") or []
    versions = output.get("versions") or [-1] * len(ids)
    logprobs = output.get("logprobs") or [0.0] * len(ids)
    texts = decode(ids) if decode else [str(i) for i in ids]
    tokens = [
        Token(id=i, text=text, version=version, logprob=logprob, colour=colours.get(version, 0))
        for i, text, version, logprob in zip(ids, texts, versions, logprobs, strict=False)
    ]
    return Choice(index, tokens, output.get("text", ""), output.get("finish_reason"))


def session_versions(interactions) -> list[int]:
    """Every policy version that produced a token of the session, oldest first."""
    versions: set[int] = set()
    for interaction in interactions:
        for output in interaction.outputs or []:
            versions.update(v for v in output.get("versions") or [] if v >= 0)
    return sorted(versions)


def _colours(interactions) -> dict[int, int]:
    return {v: i % PALETTE_SIZE for i, v in enumerate(session_versions(interactions))}


def _prompt(input_ids: list[int], stream: list[int], decode) -> PromptTokens:
    """The prompt tokens after ``stream`` (the previous turn's prompt and answer) when it is their
    prefix, else the whole prompt (the first turn, or a history the agent rewrote)."""
    new = input_ids[len(stream) :] if stream and input_ids[: len(stream)] == stream else input_ids
    texts = decode(new) if decode else [str(i) for i in new]
    return PromptTokens(list(zip(new, texts, strict=False)), len(input_ids))


TURNS_PER_PAGE = 20


@dataclass(frozen=True)
class Page:
    """Which of a session's ``turns`` the page shows: page ``number`` of ``pages`` of
    ``TURNS_PER_PAGE``, turns ``first`` to ``last`` (indexes in the session's turns)."""

    number: int
    pages: int
    first: int
    last: int
    turns: int

    @classmethod
    def of(cls, turns: int, requested: str | None) -> Page:
        """The requested page (1-based), else the last one: the latest turns of a live session."""
        pages = max(1, -(-turns // TURNS_PER_PAGE))
        try:
            number = min(max(int(requested or pages), 1), pages)
        except ValueError:
            number = pages
        first = (number - 1) * TURNS_PER_PAGE
        return cls(number, pages, first, min(first + TURNS_PER_PAGE, turns) - 1, turns)

    @property
    def size(self) -> int:
        return TURNS_PER_PAGE

    def links(self) -> list[dict]:
        """Every page as {number, label (its turns, "20–39"), current}."""
        return [
            {
                "number": n,
                "label": f"{(n - 1) * TURNS_PER_PAGE}–{min(n * TURNS_PER_PAGE, self.turns) - 1}",
                "current": n == self.number,
            }
            for n in range(1, self.pages + 1)
        ]


def conversation(
    interactions, *, decode: Callable[[list[int]], list[str]] | None, page: Page | None = None
) -> list[Turn]:
    """The turns of ``page`` (all of them without one) ready to show. Only the shown turns'
    tokens are decoded: a long session's page costs what its twenty turns do."""
    colours = _colours(interactions)
    first, last = (page.first, page.last) if page is not None else (0, len(interactions) - 1)
    turns, previous, stream = [], None, []
    for index, interaction in enumerate(interactions):
        outputs = interaction.outputs or [{}]
        chosen = interaction.chosen if interaction.chosen < len(outputs) else 0
        input_ids = interaction.input_ids or []
        if first <= index <= last:
            messages, full = new_messages(previous, interaction.messages or [])
            choices = [_choice(i, out, decode, colours) for i, out in enumerate(outputs)]
            turns.append(
                Turn(
                    interaction=interaction,
                    messages=[_printable(m) for m in messages if isinstance(m, dict)],
                    full_history=full,
                    answer=choices[chosen],
                    prompt=_prompt(list(input_ids), stream, decode),
                    other_choices=[c for c in choices if c.index != chosen],
                )
            )
        previous = interaction.messages
        stream = [*input_ids, *(outputs[chosen].get("output_ids") or [])]
    return turns


def legend(interactions) -> list[dict]:
    return [{"version": v, "colour": c} for v, c in _colours(interactions).items()]


def interaction_preview(interaction) -> dict:
    """The last message sent and the answer, short, for lists of turns."""
    messages = interaction.messages or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    outputs = interaction.outputs or [{}]
    chosen = outputs[interaction.chosen] if interaction.chosen < len(outputs) else outputs[0]
    versions = [v for v in chosen.get("versions") or [] if v >= 0]
    return {
        "interaction": interaction,
        "prompt": message_text(last.get("content")),
        "answer": chosen.get("text", ""),
        "tokens": len(chosen.get("output_ids") or []),
        "versions": sorted(set(versions)),
    }


# Self-distillation (rl_core.hints): a hint's per-token signal, teacher - student, coloured by
# its sign (green: the hint made the token likelier, red: unlikelier) and its size.
SIGNAL_STEPS = (0.05, 0.5, 2.0)  # |signal| at which the colour reaches levels 1, 2, 3


def signal_class(value: float) -> str:
    level = sum(abs(value) >= step for step in SIGNAL_STEPS)
    return "sig0" if level == 0 else f"sig{'up' if value > 0 else 'down'}{level}"


def hint_view(session, decode) -> dict | None:
    """The session's hint and, once a self-distilling step scored it, the signal it gave each
    trained token (``Session.hint_signal``); None when the session has neither."""
    scored = session.hint_signal or {}
    if not session.hint and not scored:
        return None
    parts = []
    for part in scored.get("trajectories") or []:
        ids, values = part.get("tokens") or [], part.get("signal") or []
        texts = decode(ids) if decode is not None else [str(i) for i in ids]
        parts.append(
            [
                {"id": i, "text": text, "value": value, "cls": signal_class(value)}
                for i, text, value in zip(ids, texts, values, strict=False)
            ]
        )
    return {"hint": session.hint, "scored_hint": scored.get("hint", ""), "trajectories": parts}
