"""Who may call an agent's base_url: its project's keys and its own session keys. Everyone
else is refused in OpenAI's error shape, without learning whether the agent exists."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone
from openai import AuthenticationError, NotFoundError

from webapp.accounts.models import APIKey
from webapp.accounts.services import api_key_create, api_key_revoke
from webapp.gateway.models import Interaction, Session

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "tiny-model", "messages": HI, "max_tokens": 2}
ENDPOINTS = [
    ("/chat/completions", CHAT),
    ("/rl/start_session", {}),
    ("/rl/set_reward", {"reward": 1.0, "interaction_id": "chatcmpl-x"}),
    ("/rl/end_session", None),
]


def _assert_nothing_recorded() -> None:
    assert not Session.objects.exists() and not Interaction.objects.exists()


def test_no_key_is_401(gw, openai_error):
    for path, body in ENDPOINTS:
        response = gw.post(path, body, key=None)
        error = openai_error(response, 401)
        assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
    openai_error(gw.http.get(gw.base_url + "/models"), 401)
    _assert_nothing_recorded()


def test_a_wrong_key_is_401(gw, openai_error):
    for path, body in ENDPOINTS:
        for key in ("sk-steep-not-a-key", "sk-steep-sess-not-a-key", "Bearer", "x" * 300):
            error = openai_error(gw.post(path, body, key=key), 401)
            assert error["code"] == "invalid_api_key", (path, key)
    with pytest.raises(AuthenticationError):
        gw.openai("sk-steep-not-a-key").models.list()
    _assert_nothing_recorded()


def test_a_revoked_or_expired_key_is_401(gw, project, owner, openai_error):
    _, revoked = api_key_create(project=project, name="revoked", user=owner)
    _, expired = api_key_create(
        project=project, name="old", user=owner, expires_at=timezone.now() - timedelta(days=1)
    )
    assert gw.post("/rl/start_session", key=revoked).status_code == 201  # works until revoked
    api_key_revoke(key=APIKey.objects.get(name="revoked"))

    for key in (revoked, expired):
        with pytest.raises(AuthenticationError) as exc:
            gw.openai(key).chat.completions.create(**CHAT)
        assert openai_error(exc.value, 401)["code"] == "invalid_api_key"
        openai_error(gw.post("/rl/start_session", key=key), 401)
    assert Session.objects.count() == 1 and not Interaction.objects.exists()


def test_another_projects_key_on_this_agent_is_404(gw, other_api_key, openai_error):
    for path, body in ENDPOINTS:
        error = openai_error(gw.post(path, body, key=other_api_key), 404)
        assert error["code"] == "agent_not_found" and error["type"] == "not_found_error", path
    _assert_nothing_recorded()


def test_another_projects_key_gets_the_same_404_as_an_unknown_agent(
    gw, other_api_key, openai_error
):
    with pytest.raises(NotFoundError) as foreign:
        gw.openai(other_api_key).chat.completions.create(**CHAT)
    with pytest.raises(NotFoundError):
        gw.openai(other_api_key).models.list()
    unknown_id = str(uuid.uuid4())
    unknown = gw.http.post(
        f"{gw.server}/agents/{unknown_id}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {gw.key}"},
    )
    foreign_error = openai_error(foreign.value, 404)
    unknown_error = openai_error(unknown, 404)
    assert (
        foreign_error["message"].replace(str(gw.agent.id), unknown_id) == unknown_error["message"]
    )
    assert foreign_error["code"] == unknown_error["code"]


def test_an_unknown_agent_is_404(gw, openai_error):
    for agent_id in (str(uuid.uuid4()), "not-a-uuid", "0" * 200, "%00"):
        for path, body in ENDPOINTS:
            response = gw.http.post(
                f"{gw.server}/agents/{agent_id}/v1{path}",
                json=body,
                headers={"Authorization": f"Bearer {gw.key}"},
            )
            assert openai_error(response, 404)["code"] == "agent_not_found", (agent_id, path)
    _assert_nothing_recorded()


def test_a_session_key_of_agent_a_is_404_on_agent_b(make_gateway, project, api_key, openai_error):
    a = make_gateway(project, api_key, name="a")
    b = make_gateway(project, api_key, name="b", run=a.run)
    session_id, key = a.start_session()

    with pytest.raises(NotFoundError) as exc:
        b.openai(key).chat.completions.create(**CHAT)
    assert openai_error(exc.value, 404)["code"] == "agent_not_found"
    for path, body in ENDPOINTS[1:]:
        openai_error(b.post(path, body, key=key), 404)
    session = Session.objects.get()
    assert str(session.id) == session_id and session.status == "open"
    assert not Interaction.objects.exists()


def test_a_session_key_works_on_its_own_agent_and_lists_its_model(gw):
    _, key = gw.start_session()
    assert [m.id for m in gw.openai(key).models.list().data] == [gw.model]
    gw.openai(key).chat.completions.create(**CHAT)
    assert Interaction.objects.get().session.key_hash is not None
