"""Sessions that are not one straight conversation: parallel sub-agents sharing a session key,
forks, and agent retries whose first attempt was answered but never used."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from webapp.gateway.branches import branches, conversation_tree, drop_retry_orphans
from webapp.gateway.models import Interaction, Session
from webapp.gateway.selectors import session_trajectories

HI = [{"role": "user", "content": "Hi"}]


class Agent:
    """One conversation (the main agent or a sub-agent) over a shared session key."""

    def __init__(self, client, model: str, system: str, task: str, history: list | None = None):
        self.client, self.model = client, model
        self.messages: list = [
            *(history or [{"role": "system", "content": system}]),
            {"role": "user", "content": task},
        ]
        self.ids: list[str] = []

    def turn(self, then: str = "Go on.") -> str:
        completion = self.client.chat.completions.create(
            model=self.model, messages=self.messages, max_tokens=4, seed=len(self.ids)
        )
        self.ids.append(completion.id)
        self.messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": then},
        ]
        return completion.id


def _trained_turns(trajectory) -> int:
    return sum(1 for a, b in trajectory.turn_spans() if any(trajectory.loss_mask[a:b]))


@pytest.mark.django_db(transaction=True)
def test_parallel_sub_agents_sharing_a_session_key_make_one_trajectory_each(gw):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    main = Agent(client, gw.model, "You plan.", "Split the task.")
    a = Agent(client, gw.model, "You are sub-agent A.", "Do part A.")
    b = Agent(client, gw.model, "You are sub-agent B.", "Do part B.")
    for agent in (main, a, b, a, b, a, main):  # interleaved as parallel calls land
        agent.turn()
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    gw.post("/rl/end_session", key=key)

    turns = {t.id: t for t in Interaction.objects.filter(session_id=session_id)}
    # Each continuation reused its own branch's exact tokens, not the interleaved last turn's.
    assert [turns[i].prefix_reused for i in a.ids[1:] + b.ids[1:] + main.ids[1:]] == [True] * 4
    trajectories = session_trajectories(Session.objects.get(pk=session_id))
    assert [t.metadata["interactions"] for t in trajectories] == [main.ids, a.ids, b.ids]
    for trajectory, agent in zip(trajectories, (main, a, b), strict=True):
        last = turns[agent.ids[-1]]
        assert trajectory.input_ids == last.input_ids + last.outputs[0]["output_ids"]
        assert _trained_turns(trajectory) == len(agent.ids)
    # The sub-agents' branches share the episode's outcome.
    assert [t.rewards for t in trajectories] == [[0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 1.0]]


@pytest.mark.django_db(transaction=True)
def test_two_continuations_of_one_turn_train_the_shared_turn_once(gw):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    root = Agent(client, gw.model, "You plan.", "Split the task.")
    root.turn()
    shared = list(root.messages[:-1])  # the conversation so far, answer included
    left = Agent(client, gw.model, "", "Now part A.", history=shared)
    right = Agent(client, gw.model, "", "Now part B.", history=shared)
    left.turn()
    right.turn()
    left.turn()
    gw.post("/rl/end_session", key=key)

    turns = {t.id: t for t in Interaction.objects.filter(session_id=session_id)}
    fork = turns[right.ids[0]]
    assert fork.prefix_reused  # it reused the root's tokens although the last turn was left's
    trajectories = session_trajectories(Session.objects.get(pk=session_id))
    assert [t.metadata["interactions"] for t in trajectories] == [
        root.ids + left.ids,
        right.ids,
    ]
    assert _trained_turns(trajectories[1]) == 1  # the root's answer is context there
    root_turn = turns[root.ids[0]]
    answer = root_turn.outputs[0]["output_ids"]
    start = len(root_turn.input_ids)
    assert trajectories[1].input_ids[: start + len(answer)] == root_turn.input_ids + answer


@pytest.mark.django_db(transaction=True)
def test_an_agent_retry_of_the_same_messages_leaves_no_orphan_turn_to_train(gw):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    # The first attempt was answered, but the agent gave up on it (timeout) and asked again:
    # its own retry, so not the same body (another seed), and the gateway records both.
    client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4, seed=1)
    retry = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4, seed=2)
    messages = [*HI, retry.choices[0].message, {"role": "user", "content": "Go on."}]
    after = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=4)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    gw.post("/rl/end_session", key=key)

    assert Interaction.objects.filter(session_id=session_id).count() == 3  # kept for the record
    [trajectory] = session_trajectories(Session.objects.get(pk=session_id))
    assert trajectory.metadata["interactions"] == [retry.id, after.id]
    assert trajectory.rewards == [0.0, 1.0]


@pytest.mark.django_db(transaction=True)
def test_a_retry_that_ends_the_session_keeps_only_the_latest_attempt(gw):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4, seed=1)
    retry = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4, seed=2)
    gw.post("/rl/set_reward", {"reward": 0.5}, key=key)
    gw.post("/rl/end_session", key=key)

    [trajectory] = session_trajectories(Session.objects.get(pk=session_id))
    assert trajectory.metadata["interactions"] == [retry.id]
    assert trajectory.rewards == [0.5]


# --- the rules on their own --------------------------------------------------------------


def _turn(number: int, messages: list, answer: str) -> SimpleNamespace:
    return SimpleNamespace(
        id=f"t{number}",
        turn=number,
        messages=messages,
        tools=None,
        chosen=0,
        prefix_reused=False,
        response={"choices": [{"message": {"role": "assistant", "content": answer}}]},
    )


def _say(text: str) -> dict:
    return {"role": "user", "content": text}


def _reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _ids(nodes) -> list[str]:
    return [n.turn.id for n in nodes]


def test_attempts_that_were_all_continued_are_branches_not_orphans():
    turns = [
        _turn(0, [_say("hi")], "a"),
        _turn(1, [_say("hi")], "b"),
        _turn(2, [_say("hi"), _reply("a"), _say("x")], "c"),
        _turn(3, [_say("hi"), _reply("b"), _say("y")], "d"),
    ]
    kept, orphans = drop_retry_orphans(conversation_tree(turns))
    assert orphans == []
    assert [_ids(branch) for branch in branches(kept)] == [["t0", "t2"], ["t1", "t3"]]


def test_a_mid_conversation_retry_drops_only_the_attempt_nobody_continued():
    q1 = [_say("q1")]
    q2 = [*q1, _reply("a1"), _say("q2")]
    turns = [
        _turn(0, q1, "a1"),
        _turn(1, q2, "lost"),
        _turn(2, q2, "a2"),
        _turn(3, [*q2, _reply("a2"), _say("q3")], "a3"),
    ]
    kept, orphans = drop_retry_orphans(conversation_tree(turns))
    assert _ids(orphans) == ["t1"]
    assert [_ids(branch) for branch in branches(kept)] == [["t0", "t2", "t3"]]


def test_an_echoed_answer_with_sdk_extras_still_continues_its_turn():
    echoed = {"role": "assistant", "content": "a", "refusal": None, "tool_calls": None}
    turns = [_turn(0, [_say("hi")], "a"), _turn(1, [_say("hi"), echoed, _say("more")], "b")]
    nodes = conversation_tree(turns)
    assert nodes[1].parent is nodes[0]
