"""Turns stored as what they added (issue 36, ``webapp.gateway.deltas``) read back whole: by
the ORM (a whole session, one turn, a slice), by the gateway's raw SQL, and saved whole again."""

from __future__ import annotations

import pytest
from django.db import connection

from webapp.gateway import earlier_turns
from webapp.gateway.models import Interaction

pytestmark = pytest.mark.django_db

USER = {"role": "user"}


@pytest.fixture
def sessions(project, make_run, make_agent, make_session, tokenizer_dir):
    agent = make_agent(project, run=make_run(project, base_model=str(tokenizer_dir)))
    turns = [
        {
            "messages": [USER | {"content": f"Question {i}?"}],
            "answer": f"Answer {i}.",
            "versions": 1,
        }
        for i in range(6)
    ]
    return make_session(agent, turns, stored_as_added=True), make_session(agent, turns)


def _columns(session) -> list[tuple]:
    return list(
        Interaction.objects.filter(session=session)
        .order_by("turn")
        .values_list("messages", "input_ids")
    )


def test_rows_hold_what_each_turn_added_and_read_back_whole(sessions):
    added, whole = sessions
    stored, full = _columns(added), _columns(whole)
    for turn in range(1, 6):  # stored: the echoed answer and the new question, their tokens
        assert [m["content"] for m in stored[turn][0]] == [
            f"Answer {turn - 1}.",
            f"Question {turn}?",
        ]
        assert len(stored[turn][1]) < len(full[turn][1]) - len(full[turn - 1][1])
    by_orm = list(added.interactions.order_by("turn"))
    expected = list(whole.interactions.order_by("turn"))
    assert [(t.messages, t.input_ids) for t in by_orm] == [
        (t.messages, t.input_ids) for t in expected
    ]
    # One turn alone, a slice, and the gateway's raw SQL: whole too.
    one = Interaction.objects.get(session=added, turn=4)
    assert (one.messages, one.input_ids) == (expected[4].messages, expected[4].input_ids)
    tail = list(Interaction.objects.filter(session=added, turn__gte=3).order_by("turn"))
    assert [t.input_ids for t in tail] == [t.input_ids for t in expected[3:]]
    with connection.cursor() as cursor:
        row = earlier_turns.whole_turn(cursor, added.id, 5)
    assert (row.messages, row.input_ids) == (expected[5].messages, expected[5].input_ids)
    # Left as stored where the columns were not all read.
    deferred = Interaction.objects.defer("input_ids").get(session=added, turn=4)
    assert deferred.messages == stored[4][0]


def test_a_whole_turn_saved_is_stored_whole_and_refreshed_whole(sessions):
    added, whole = sessions
    turn = Interaction.objects.get(session=added, turn=3)
    turn.reward = 0.5
    turn.save()
    assert (
        Interaction.objects.filter(pk=turn.pk).values_list("prefix_turn", flat=True).get() is None
    )
    again = Interaction.objects.get(session=added, turn=5)  # continues 4, which continues 3
    assert again.input_ids == Interaction.objects.get(session=whole, turn=5).input_ids
    again.refresh_from_db()
    assert again.input_ids == Interaction.objects.get(session=whole, turn=5).input_ids
