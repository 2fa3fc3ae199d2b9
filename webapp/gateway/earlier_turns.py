"""Earlier turns of a session as the next turn continues them: the last turn read from its
row (when this process does not hold it: ``webapp.gateway.last_turns``), and, for a request
that does not continue the last turn, the earlier turn it branches from (a parallel
sub-agent, a fork: ``webapp.gateway.branches``). Lane operations' helpers on a DB-API cursor,
as ``webapp.gateway.turns``; a turn stored as what it added is read whole
(``webapp.gateway.deltas``).
"""

from __future__ import annotations

from webapp.gateway import deltas, sql
from webapp.gateway.chat_request import PreviousTurn, continued_choice, normalize_message
from webapp.gateway.models import Interaction, Session

_INTERACTIONS = Interaction._meta.db_table


def read_turn(
    cursor, session_id, number: int, row: tuple | None
) -> tuple[PreviousTurn | None, tuple[str, dict] | None]:
    """Turn ``number`` of the session as read by ``authenticate(..., last_turn=True)`` or
    ``branch_parent``: its request_hash, messages, tools, input_ids, outputs, response, id and
    prefix_turn; returns the ``PreviousTurn`` (its whole conversation: a turn that stored what
    it added is put together with the turns before, ``webapp.gateway.deltas``) and
    (request_hash, response)."""
    if row is None:
        return None, None
    response = sql.loads(row[5])
    messages, input_ids, outputs = sql.loads(row[1]), sql.loads(row[3]), sql.loads(row[4])
    if row[7] is not None:
        whole = whole_turn(cursor, session_id, number)
        if whole is None:
            return None, (row[0], response)
        messages, input_ids = whole.messages, whole.input_ids
    previous = previous_turn(
        messages, sql.loads(row[2]), input_ids, outputs, response, row[6], number
    )
    return previous, (row[0], response)


def previous_turn(
    messages, tools, input_ids, outputs, response: dict, key: str, number: int
) -> PreviousTurn:
    """A recorded turn as the next one continues it: per choice, its ids and message."""
    return PreviousTurn(
        messages=messages,
        tools=tools,
        input_ids=input_ids,
        choices=[
            {"output_ids": out["output_ids"], "message": choice["message"]}
            for out, choice in zip(outputs, response["choices"], strict=True)
        ],
        key=key,
        turn=number,
    )


BRANCH_CANDIDATES = 16  # how many earlier turns a branch's parent is looked for among


def branch_parent(*, session_id, last_turn: int, messages: list, tools):
    """The operation that finds the turn a request continues when it does not continue the
    session's last turn (``last_turn``): a parallel sub-agent's own conversation, or a fork.

    Only this rarer path pays for it: among the ``BRANCH_CANDIDATES`` turns before the last,
    the one whose conversation (messages and an answer) ``messages`` extend the furthest, the
    latest of equals. A first statement reads each candidate's message count and answers only
    (not its tokens), which finds the candidates whose answer sits where ``messages`` continue;
    the best of those is then read whole and checked. Returns a ``PreviousTurn`` or None.
    """

    def operation(cursor) -> PreviousTurn | None:
        session_pk = sql.pk(cursor, Session, session_id)
        counts = _message_counts(cursor, session_pk, last_turn)
        cursor.execute(
            f"SELECT turn, response FROM {_INTERACTIONS}"
            " WHERE session_id = %s AND turn < %s ORDER BY turn DESC LIMIT %s",
            [session_pk, last_turn, BRANCH_CANDIDATES],
        )
        answers: dict[int, dict] = {}  # normalised messages[k], computed once per k
        candidates = []
        for turn, response in cursor.fetchall():
            k = counts.get(int(turn), 0)
            if k >= len(messages) or not isinstance(messages[k], dict):
                continue
            answer = answers.setdefault(k, normalize_message(messages[k]))
            choices = (sql.loads(response) or {}).get("choices") or []
            if any(normalize_message(c.get("message") or {}) == answer for c in choices):
                candidates.append((k, int(turn)))
        for _, turn in sorted(candidates, reverse=True):  # the longest, then the latest
            cursor.execute(
                f"SELECT request_hash, messages, tools, input_ids, outputs, response, id,"
                f" prefix_turn FROM {_INTERACTIONS} WHERE session_id = %s AND turn = %s",
                [session_pk, turn],
            )
            candidate, _ = read_turn(cursor, session_id, turn, cursor.fetchone())
            if candidate is None or (tools or None) != (candidate.tools or None):
                continue
            if continued_choice(messages, candidate) is not None:
                return candidate
        return None

    return operation


def _message_counts(cursor, session_pk, before: int) -> dict[int, int]:
    """Each turn's whole conversation length in messages, for the turns before ``before``
    (a turn that stored what it added counts the turn it continues)."""
    count = "json_array_length" if cursor.db.vendor == "sqlite" else "jsonb_array_length"
    cursor.execute(
        f"SELECT turn, prefix_turn, {count}(messages) FROM {_INTERACTIONS}"
        " WHERE session_id = %s AND turn < %s ORDER BY turn",
        [session_pk, before],
    )
    counts: dict[int, int] = {}
    for turn, prefix_turn, length in cursor.fetchall():
        base = 0 if prefix_turn is None else counts.get(int(prefix_turn), 0)
        counts[int(turn)] = base + int(length or 0)
    return counts


def whole_turn(cursor, session_id, turn: int) -> deltas.TurnRow | None:
    """Turn ``turn`` of the session with its whole messages and input_ids: one statement over
    the session's turns up to it (the turns it continues are among them)."""
    cursor.execute(
        f"SELECT turn, prefix_turn, prefix_choice, messages, input_ids, outputs FROM {_INTERACTIONS}"
        " WHERE session_id = %s AND turn <= %s ORDER BY turn",
        [sql.pk(cursor, Session, session_id), turn],
    )
    rows = [
        deltas.TurnRow(
            turn=int(row[0]),
            prefix_turn=None if row[1] is None else int(row[1]),
            prefix_choice=None if row[2] is None else int(row[2]),
            messages=sql.loads(row[3]),
            input_ids=sql.loads(row[4]),
            outputs=sql.loads(row[5]),
        )
        for row in cursor.fetchall()
    ]
    if not rows or rows[-1].turn != turn:
        return None
    deltas.expand(rows)
    return rows[-1]
