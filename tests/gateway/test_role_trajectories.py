"""A multi-agent session becomes one trajectory per role: a role's turns extend its own
sequence, the other roles' tokens between them are untrained context, and the episode's
reward reaches every role."""

from __future__ import annotations

import pytest

from tests.gateway import role_engine
from webapp.gateway.models import Interaction, Session
from webapp.gateway.selectors import session_trajectories

pytestmark = pytest.mark.django_db(transaction=True)
fake_engine, roles_gw = role_engine.fake_engine, role_engine.roles_gw  # fixtures
_turn = role_engine.play_turn


def _span(turn: Interaction) -> range:
    start = len(turn.input_ids)
    return range(start, start + len(turn.outputs[0]["output_ids"]))


def test_a_mixed_session_yields_one_trajectory_per_role_with_the_episode_reward(roles_gw):
    session_id, key = roles_gw.start_session()
    client, messages = roles_gw.openai(key), [{"role": "user", "content": "Describe it"}]
    first, heard, second = (
        _turn(client, "policy/speaker", messages),
        _turn(client, "policy/listener", messages),
        _turn(client, "policy/speaker", messages),
    )
    assert roles_gw.post("/rl/set_reward", {"reward": 1.0}, key=key).status_code == 200
    assert roles_gw.post("/rl/end_session", key=key).status_code == 200

    session = Session.objects.get(pk=session_id)
    speaker, listener = session_trajectories(session)
    turns = {t.id: t for t in Interaction.objects.filter(session_id=session_id)}

    assert (speaker.role, listener.role) == ("speaker", "listener")
    assert speaker.metadata["interactions"] == [first, second]
    assert listener.metadata["interactions"] == [heard]
    # The speaker's sequence is its last turn's whole stream; only its own answers are trained.
    assert speaker.input_ids[: len(turns[second].input_ids)] == turns[second].input_ids
    trained = {i for i, m in enumerate(speaker.loss_mask) if m}
    assert trained == {*_span(turns[first]), *_span(turns[second])}
    for i in _span(turns[heard]):  # the listener's answer: context in the speaker's sequence
        assert (speaker.loss_mask[i], speaker.versions[i]) == (0, -1)
    assert {i for i, m in enumerate(listener.loss_mask) if m} == set(_span(turns[heard]))
    # The episode's reward (set on the last turn, the speaker's) reaches the listener too.
    assert speaker.rewards == [0.0, 1.0] and listener.rewards == [1.0]
    assert {speaker.session_id, listener.session_id} == {f"{session_id}#0", f"{session_id}#1"}
    assert speaker.to_dict()["role"] == "speaker"


def test_a_per_role_reward_stays_with_its_role(roles_gw):
    session_id, key = roles_gw.start_session()
    client, messages = roles_gw.openai(key), [{"role": "user", "content": "Describe it"}]
    _turn(client, "policy/speaker", messages)
    _turn(client, "policy/listener", messages)
    roles_gw.post("/rl/set_reward", {"reward": -1.0, "role": "listener"}, key=key)
    roles_gw.post("/rl/set_reward", {"reward": 2.0, "role": "speaker"}, key=key)
    roles_gw.post("/rl/end_session", key=key)

    speaker, listener = session_trajectories(Session.objects.get(pk=session_id))
    assert (speaker.rewards, listener.rewards) == ([2.0], [-1.0])
