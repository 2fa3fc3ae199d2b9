"""A session's turns as stored (what each added) and as read (the whole conversation).

A turn whose prompt continues an earlier turn's exact tokens (``webapp.gateway.prompts``)
stores only what it added: ``prefix_turn`` names the turn it continues and ``prefix_choice``
which of that turn's answers, ``messages`` holds the messages after that turn's (the answer
as the agent echoed it, then the new ones) and ``input_ids`` the tokens after that turn's
prompt and answer. A turn of a long session then writes a row the size of a turn, not of the
conversation so far (issue 36: at 128 turns every turn rewrote ~26 KB). A turn rendered afresh
stores itself whole (``prefix_turn`` None), and so do rows written before this existed.

Readers get the whole conversation back: the ORM's ``Interaction`` rows come whole (their
queryset puts each turn together with the turns it continues, reading those it lacks), and
the gateway's raw-SQL paths use ``earlier_turns.whole_turn``. Both go through ``expand``.
This module imports no model, so that ``webapp.gateway.models`` can use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Prefix:
    """What a turn's prompt continues: turn ``turn``'s choice ``choice``, whose conversation is
    ``messages`` messages and whose prompt and answer are ``ids`` tokens long."""

    turn: int
    choice: int
    messages: int
    ids: int


def stored(prefix: Prefix | None, messages: list, input_ids: list[int]) -> dict[str, Any]:
    """The columns of a turn: the whole messages and ids, or what follows ``prefix``."""
    if prefix is None:
        return {"messages": messages, "input_ids": input_ids}
    return {
        "messages": messages[prefix.messages :],
        "input_ids": input_ids[prefix.ids :],
        "prefix_turn": prefix.turn,
        "prefix_choice": prefix.choice,
    }


def expand(turns: Iterable[Any]) -> None:
    """Give each turn its whole ``messages`` and ``input_ids`` (in place), from the turns it
    continues; ``turns`` is a session's turns (or a prefix of them: every turn a turn
    continues comes before it). Expanding twice changes nothing."""
    by_number: dict[int, Any] = {}
    for turn in sorted(turns, key=lambda t: t.turn):
        by_number[turn.turn] = turn
        if turn.prefix_turn is None or getattr(turn, "_whole", False):
            continue
        parent = by_number.get(turn.prefix_turn)
        if parent is None or not (getattr(parent, "_whole", False) or parent.prefix_turn is None):
            raise ValueError(
                f"turn {turn.turn} continues turn {turn.prefix_turn}, which is not among the turns read"
            )
        answer = parent.outputs[turn.prefix_choice or 0]["output_ids"]
        turn.messages = [*parent.messages, *(turn.messages or [])]
        turn.input_ids = [*parent.input_ids, *answer, *(turn.input_ids or [])]
        turn._whole = True


@dataclass
class TurnRow:
    """A turn as ``expand`` reads it, from columns rather than a model row."""

    turn: int
    prefix_turn: int | None
    prefix_choice: int | None
    messages: list
    input_ids: list[int]
    outputs: list[dict]
