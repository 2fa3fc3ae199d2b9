"""A web process's copy of each session's last turn (``webapp.gateway.last_turns``): it is what
the row gives back, it is used only while the session key still names that session at the turn
count it was kept under, and a turn recorded elsewhere is read from the database instead.

The operations run here, in the test process, on a Django cursor (as the views' route runs
them); the last test drives the live server, another process, beside them."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
from django.db import connection, transaction

from webapp.accounts.keys import SESSION_KEY_PREFIX, generate_key
from webapp.gateway import deltas, earlier_turns, episodes, inflight, turns
from webapp.gateway.chat_request import PreviousTurn
from webapp.gateway.last_turns import KnownTurn, LastTurns
from webapp.gateway.models import Interaction
from webapp.runs.services import run_mark_running

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["word"],
            },
        },
    }
]


def _run(operation):
    with transaction.atomic(), connection.cursor() as cursor:
        return operation(cursor)


@pytest.fixture
def agent(project, make_run, make_agent):
    run = run_mark_running(run=make_run(project, name="copies"), message="test")
    return make_agent(project, name="copier", run=run)


@pytest.fixture
def session_key(agent, api_key) -> str:
    key = generate_key(SESSION_KEY_PREFIX)
    _run(episodes.start(token=api_key, agent_id=agent.id, task_id="t", metadata={}, new_key=key))
    return key


@pytest.fixture(autouse=True)
def fresh_copies(monkeypatch) -> LastTurns:
    """This process's copies, empty at the start of each test."""
    copies = LastTurns()
    monkeypatch.setattr(turns, "LAST_TURNS", copies)
    return copies


def _record(
    agent,
    key: str,
    *,
    request_hash: str,
    ids: list[int],
    contents: list[str],
    answer_ids: list[list[int]] | None = None,
    messages: list[dict] | None = None,
    tools: list[dict] | None = TOOLS,
    prefix=None,
):
    """One turn of the session of ``key`` recorded as the gateway records it, without keeping a
    copy (``turns.remember``): as another web process would. A choice per ``contents`` (with
    ``answer_ids``, or made-up ids); ``messages`` default to a conversation with a tool call.
    Returns the ``Recorded`` and the ``Turn`` it was recorded for."""
    turn = _run(turns.begin(token=key, agent_id=agent.id, fingerprint=request_hash, is_retry=False))
    assert turn.replay is None
    if messages is None:
        messages = [
            {"role": "system", "content": "Be brief. Ünïcode: 日本語 \u2028 \\ \" '"},
            {"role": "user", "content": [{"type": "text", "text": "Look up 'steep'."}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "lookup",
                            "arguments": '{"word": "steep", "limit": 2}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "steep: rising sharply"},
            {"role": "user", "content": f"And now? ({request_hash})"},
        ]
    answer_ids = answer_ids or [[ids[-1] + index + 1, 17, 2] for index in range(len(contents))]
    outputs, choices = [], []
    for index, (content, out_ids) in enumerate(zip(contents, answer_ids, strict=True)):
        outputs.append(
            {
                "output_ids": out_ids,
                "logprobs": [-0.123456789012345, -1e-07] + [-3.5] * (len(out_ids) - 2),
                "versions": [0] * len(out_ids),
                "finish_reason": "stop",
                "text": content,
            }
        )
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
                "matched_stop": "\n\n",
                "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120]}]},
            }
        )
    response = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "tiny",
        "system_fingerprint": "steep-v0",
        "choices": choices,
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 3, "total_tokens": 0},
    }
    n = len(contents)
    return _run(
        turns.record(
            turn=turn,
            interaction_id=response["id"],
            request_hash=request_hash,
            messages=messages,
            tools=tools,
            sampling={"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 8, "n": n, "seed": 3},
            input_ids=ids,
            prefix_reused=False,
            outputs=outputs,
            response=response,
            server_url="http://engine.test",
            latency_ms=1.5,
            previous_chosen=None,
            prefix=prefix,
        )
    ), turn


def _caller(agent, key: str) -> turns.Caller:
    return _run(
        lambda cursor: turns.authenticate(cursor, token=key, agent_id=agent.id, last_turn=True)
    )


def _from_row(caller: turns.Caller) -> tuple[PreviousTurn | None, tuple | None]:
    assert caller.known_turn is None and caller.last_turn is not None
    return _run(
        lambda cursor: earlier_turns.read_turn(
            cursor, caller.session_id, caller.session_turns - 1, caller.last_turn
        )
    )


@pytest.mark.django_db
def test_the_copy_of_a_recorded_turn_is_what_its_row_gives_back(agent, session_key):
    recorded, turn = _record(
        agent, session_key, request_hash="first", ids=[1, 5, 300, 7], contents=["Sure", "Fine"]
    )
    copy = recorded.turn
    assert isinstance(copy, KnownTurn)
    assert (copy.session_id, copy.count) == (turn.session_id, 1)

    previous, (request_hash, response) = _from_row(_caller(agent, session_key))
    assert copy.previous == previous  # messages, tools, prompt ids, per choice ids + message, key
    assert (copy.request_hash, copy.response) == (request_hash, response)
    assert copy.previous.key == response["id"] == recorded.response["id"]

    turns.remember(turn, recorded)
    caller = _caller(agent, session_key)
    assert caller.known_turn is copy and caller.last_turn is None  # the row's columns left out
    # An SDK retry of that turn is answered from the copy, and nothing is recorded again.
    again = _run(
        turns.begin(token=session_key, agent_id=agent.id, fingerprint="first", is_retry=True)
    )
    assert again.replay == response
    following = _run(
        turns.begin(token=session_key, agent_id=agent.id, fingerprint="next", is_retry=False)
    )
    assert following.replay is None and following.previous is copy.previous


@pytest.mark.django_db
def test_a_copy_is_used_only_for_its_session_at_its_turn_count(agent, session_key, monkeypatch):
    first, turn = _record(agent, session_key, request_hash="one", ids=[1, 2, 3], contents=["A"])
    turns.remember(turn, first)
    # A second turn recorded elsewhere (no copy kept here): the session moved past the copy.
    second, _ = _record(agent, session_key, request_hash="two", ids=[1, 2, 3, 4], contents=["B"])
    caller = _caller(agent, session_key)
    previous, (request_hash, _) = _from_row(caller)
    assert (request_hash, previous) == ("two", second.turn.previous)

    # At the session's count a copy is trusted as it is: one with other ids is what is used.
    planted = replace(second.turn, previous=replace(second.turn.previous, input_ids=[9, 9, 9]))
    turns.LAST_TURNS.put(caller.key_hash, planted)
    assert _caller(agent, session_key).known_turn is planted

    # The key rebound to a new session (start_session with it): a copy of the old session at
    # the new one's count is not used, the new session's row is.
    started = _run(
        episodes.start(token=session_key, agent_id=agent.id, task_id="u", metadata={}, new_key="")
    )
    assert started["api_key"] == session_key and started["session_id"] != str(turn.session_id)
    fresh, _ = _record(agent, session_key, request_hash="three", ids=[4, 5], contents=["C"])
    copies = LastTurns()  # (a copy of an earlier turn of the same session would not replace it)
    monkeypatch.setattr(turns, "LAST_TURNS", copies)
    copies.put(caller.key_hash, replace(first.turn, count=1))  # the old session, at count 1
    caller = _caller(agent, session_key)
    assert caller.session_id == fresh.turn.session_id and caller.session_turns == 1
    previous, (request_hash, _) = _from_row(caller)
    assert (request_hash, previous) == ("three", fresh.turn.previous)


def _known(session: uuid.UUID, count: int, ids: int) -> KnownTurn:
    previous = PreviousTurn(messages=[], tools=None, input_ids=[0] * ids, choices=[], key="k")
    return KnownTurn(session, count, previous, "h", {})


def test_the_copies_are_bounded_by_sessions_and_token_ids_least_recently_used_first():
    copies = LastTurns(max_sessions=3, max_token_ids=100)
    a, b, c, d = (uuid.uuid4() for _ in range(4))
    copies.put("a", _known(a, 1, 10))
    copies.put("b", _known(b, 1, 10))
    copies.put("c", _known(c, 1, 10))
    assert copies.get("a") is not None  # now the most recently used
    copies.put("d", _known(d, 1, 10))
    assert (copies.get("b"), len(copies), copies.token_ids) == (None, 3, 30)

    copies.put("e", _known(uuid.uuid4(), 1, 75))  # 105 ids: the least recent (c) goes
    assert copies.get("c") is None and copies.get("a") is not None
    assert copies.token_ids <= 100
    copies.put("big", _known(uuid.uuid4(), 1, 101))  # larger than all of it: not kept
    assert copies.get("big") is None and copies.get("a") is not None

    later = _known(a, 5, 10)
    copies.put("a", later)
    copies.put("a", _known(a, 4, 10))  # an earlier turn of the session remembered last
    assert copies.get("a") is later
    rebound = _known(uuid.uuid4(), 1, 10)
    copies.put("a", rebound)  # a new session on the key, at a lower count: replaces it
    assert copies.get("a") is rebound
    assert copies.token_ids == sum(k.token_ids for k in copies._turns.values())


@pytest.mark.django_db(transaction=True)
def test_a_turn_another_process_recorded_is_read_from_the_database(gw, chat_tokenizer):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    hi = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model=gw.model, messages=hi, max_tokens=3)
    # The live server keeps a copy of that turn. This process records the session's next one,
    # its text as a render gives it but its ids spelled one character at a time, as no
    # tokenizer run gives them: a prompt built on this turn begins with those ids.
    messages = [*hi, first.choices[0].message.model_dump(exclude_none=True)]
    messages.append({"role": "user", "content": "Again?"})
    answer = {"role": "assistant", "content": "Elsewhere"}
    prompt = chat_tokenizer.render(messages)
    answered = chat_tokenizer.render([*messages, answer], add_generation_prompt=False)
    assert answered.startswith(prompt)

    def spelled(text: str) -> list[int]:
        return [i for character in text for i in chat_tokenizer.encode(character)]

    ids, answer_ids = spelled(prompt), spelled(answered[len(prompt) :])
    assert chat_tokenizer.decode(ids + answer_ids, skip_special_tokens=False) == answered
    idempotency = "recorded-by-another-worker"
    recorded, _ = _record(
        gw.agent,
        key,
        request_hash=inflight.request_key("", idempotency),
        ids=ids,
        contents=["Elsewhere"],
        answer_ids=[answer_ids],
        messages=messages,
        tools=None,
    )
    assert recorded.turn.count == 2

    # The same request sent to the server is that turn's retry: answered from its row.
    body = {"model": gw.model, "messages": messages, "max_tokens": 3}
    retried = gw.post("/chat/completions", body, key=key, headers={"Idempotency-Key": idempotency})
    assert retried.status_code == 200, retried.text
    assert retried.json()["id"] == recorded.response["id"] != first.id
    # The next turn continues it (not the copy of the turn before).
    following = client.chat.completions.create(
        model=gw.model,
        messages=[*messages, answer, {"role": "user", "content": "More?"}],
        max_tokens=3,
    )
    turn = Interaction.objects.get(pk=following.id)
    assert (turn.session_id, turn.turn, turn.prefix_reused) == (uuid.UUID(session_id), 2, True)
    assert turn.input_ids[: len(ids) + len(answer_ids)] == ids + answer_ids


@pytest.mark.django_db
def test_a_turn_stored_as_what_it_added_is_read_back_whole_by_another_process(agent, session_key):
    """Issue 36: the second turn's row holds only what it added to the first (``deltas``); a
    process without the copy reads the session's rows up to it and puts the turn together."""
    first, _ = _record(agent, session_key, request_hash="one", ids=[1, 2, 3], contents=["A"])
    earlier = first.turn.previous
    messages = [
        *earlier.messages,
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "More?"},
    ]
    ids = [*earlier.input_ids, *earlier.choices[0]["output_ids"], 40, 41]
    prefix = deltas.Prefix(0, 0, len(earlier.messages), len(ids) - 2)
    second, _ = _record(
        agent, session_key, request_hash="two", ids=ids, contents=["B"], messages=messages,
        prefix=prefix,
    )  # fmt: skip
    stored = Interaction.objects.filter(turn=1).values("messages", "input_ids", "prefix_turn").get()
    assert stored == {"messages": messages[-2:], "input_ids": [40, 41], "prefix_turn": 0}
    previous, (request_hash, _) = _from_row(_caller(agent, session_key))
    assert request_hash == "two" and previous == second.turn.previous
    assert (previous.messages, previous.input_ids, previous.turn) == (messages, ids, 1)
