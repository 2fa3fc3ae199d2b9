"""``/rl/set_reward`` with ``role``: the reward goes on the session's last turn of that role;
a role the run lacks, or any role on a one-policy run, is a 400."""

from __future__ import annotations

import pytest

from tests.gateway import role_engine
from webapp.gateway.models import Interaction

pytestmark = pytest.mark.django_db(transaction=True)
fake_engine, roles_gw = role_engine.fake_engine, role_engine.roles_gw  # fixtures
_turn = role_engine.play_turn


def test_set_reward_with_a_role_rewards_that_roles_last_turn(roles_gw):
    session_id, key = roles_gw.start_session()
    client, messages = roles_gw.openai(key), [{"role": "user", "content": "Hi"}]
    _turn(client, "policy/speaker", messages)
    listener_turn = _turn(client, "policy/listener", messages)
    speaker_turn = _turn(client, "policy/speaker", messages)

    response = roles_gw.post("/rl/set_reward", {"reward": 0.5, "role": "listener"}, key=key)

    assert response.status_code == 200, response.text
    assert response.json()["interaction_id"] == listener_turn
    assert Interaction.objects.get(pk=listener_turn).reward == 0.5
    assert Interaction.objects.get(pk=speaker_turn).reward is None


def test_set_reward_naming_a_turn_and_another_role_is_400_and_changes_nothing(
    roles_gw, openai_error
):
    _, key = roles_gw.start_session()
    client, messages = roles_gw.openai(key), [{"role": "user", "content": "Hi"}]
    speaker_turn = _turn(client, "policy/speaker", messages)
    body = {"reward": 1.0, "interaction_id": speaker_turn, "role": "listener"}

    error = openai_error(roles_gw.post("/rl/set_reward", body, key=key), 400)

    assert error["param"] == "role" and error["code"] == "role_mismatch"
    assert "'speaker'" in error["message"]
    assert Interaction.objects.get(pk=speaker_turn).reward is None
    body["role"] = "speaker"
    assert roles_gw.post("/rl/set_reward", body, key=key).status_code == 200
    assert Interaction.objects.get(pk=speaker_turn).reward == 1.0


def test_set_reward_with_a_role_the_session_has_not_played_is_409(roles_gw, openai_error):
    _, key = roles_gw.start_session()
    _turn(roles_gw.openai(key), "policy/speaker", [{"role": "user", "content": "Hi"}])
    response = roles_gw.post("/rl/set_reward", {"reward": 1.0, "role": "listener"}, key=key)
    assert openai_error(response, 409)["code"] == "no_interaction"


def test_set_reward_with_a_role_the_run_lacks_is_400_naming_its_roles(roles_gw, openai_error):
    _, key = roles_gw.start_session()
    response = roles_gw.post("/rl/set_reward", {"reward": 1.0, "role": "judge"}, key=key)
    error = openai_error(response, 400)
    assert error["param"] == "role" and "speaker, listener" in error["message"]
    response = roles_gw.post("/rl/set_reward", {"reward": 1.0, "role": 3}, key=key)
    assert openai_error(response, 400)["code"] == "invalid_type"


def test_set_reward_with_a_role_on_a_run_without_roles_is_400(
    make_gateway, project, api_key, fake_engine, openai_error
):
    gw = make_gateway(project, api_key, servers=[fake_engine.url])
    _, key = gw.start_session()
    response = gw.post("/rl/set_reward", {"reward": 1.0, "role": "speaker"}, key=key)
    assert openai_error(response, 400)["param"] == "role"
