"""A multi-agent run: each request is answered by its role's adapter (``model: "policy/<role>"``
or the agent's bound role), the turn records the role, and a request without one is refused."""

from __future__ import annotations

import pytest
from openai import BadRequestError, NotFoundError

from tests.gateway import role_engine
from webapp.agents.services import agent_create
from webapp.gateway.models import Interaction
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)
fake_engine, roles_gw = role_engine.fake_engine, role_engine.roles_gw  # fixtures

HI = [{"role": "user", "content": "Hi"}]


def test_model_policy_role_sends_that_roles_adapter_and_records_the_role(roles_gw, fake_engine):
    reply = roles_gw.openai().chat.completions.create(
        model="policy/speaker", messages=HI, max_tokens=2
    )
    assert fake_engine.requests[-1]["lora_path"] == f"{roles_gw.run.pk}-speaker-v3"
    assert Interaction.objects.get(pk=reply.id).role == "speaker"


def test_an_agent_bound_to_a_role_gets_its_adapter_without_naming_it(
    roles_gw, fake_engine, project
):
    listener = agent_create(project=project, name="listener", run=roles_gw.run, role="listener")
    roles_gw.agent = listener
    reply = roles_gw.openai().chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)
    assert fake_engine.requests[-1]["lora_path"] == f"{roles_gw.run.pk}-listener-v3"
    assert Interaction.objects.get(pk=reply.id).role == "listener"
    # The request's role wins over the agent's.
    roles_gw.openai().chat.completions.create(model="policy/speaker", messages=HI, max_tokens=2)
    assert fake_engine.requests[-1]["lora_path"] == f"{roles_gw.run.pk}-speaker-v3"


def test_a_request_without_a_role_is_400_naming_the_roles(roles_gw, fake_engine, openai_error):
    with pytest.raises(BadRequestError) as exc:
        roles_gw.openai().chat.completions.create(model="policy", messages=HI, max_tokens=2)
    error = openai_error(exc.value, 400)
    assert error["param"] == "model"
    assert error["message"] == (
        'This run trains roles speaker, listener: send model "policy/<role>" '
        "or bind the agent to a role."
    )
    assert not fake_engine.requests and not Interaction.objects.exists()
    run = Run.objects.get(pk=roles_gw.run.pk)
    assert run.sessions_open == 0  # the refused one-turn completion holds no admission slot


def test_an_unknown_role_is_404_model_not_found(roles_gw, fake_engine, openai_error):
    with pytest.raises(NotFoundError) as exc:
        roles_gw.openai().chat.completions.create(model="policy/judge", messages=HI, max_tokens=2)
    error = openai_error(exc.value, 404)
    assert error["code"] == "model_not_found"
    assert "speaker, listener" in error["message"]
    assert not fake_engine.requests


def test_another_projects_key_cannot_name_a_role_of_this_run(
    roles_gw, fake_engine, other_api_key, openai_error
):
    with pytest.raises(NotFoundError) as exc:
        roles_gw.openai(other_api_key).chat.completions.create(
            model="policy/speaker", messages=HI, max_tokens=2
        )
    assert openai_error(exc.value, 404)["code"] == "agent_not_found"
    assert not fake_engine.requests and not Interaction.objects.exists()


def test_models_lists_the_policy_and_each_role(roles_gw):
    ids = [model.id for model in roles_gw.openai().models.list().data]
    assert ids[:3] == ["policy", "policy/speaker", "policy/listener"]


def test_a_run_without_roles_ignores_the_model(make_gateway, project, api_key, fake_engine):
    gw = make_gateway(project, api_key, servers=[fake_engine.url], lora_rank=8)
    Run.objects.filter(pk=gw.run.pk).update(weight_version=2)
    reply = gw.openai().chat.completions.create(model="policy/speaker", messages=HI, max_tokens=2)
    assert fake_engine.requests[-1]["lora_path"] == f"{gw.run.pk}-v2"
    assert Interaction.objects.get(pk=reply.id).role == ""
    assert [m.id for m in gw.openai().models.list().data] == [gw.model_dir.name]


def test_the_responses_and_messages_apis_pick_the_role_from_the_model_too(roles_gw, fake_engine):
    answer = roles_gw.post(
        "/responses", {"model": "policy/listener", "input": "Hi", "max_output_tokens": 2}
    )
    assert answer.status_code == 200, answer.text
    assert fake_engine.requests[-1]["lora_path"] == f"{roles_gw.run.pk}-listener-v3"
    answer = roles_gw.post(
        "/messages", {"model": "policy/speaker", "max_tokens": 2, "messages": HI}
    )
    assert answer.status_code == 200, answer.text
    assert fake_engine.requests[-1]["lora_path"] == f"{roles_gw.run.pk}-speaker-v3"
    assert sorted(Interaction.objects.values_list("role", flat=True)) == ["listener", "speaker"]
