"""Agents of a multi-agent run: bound to one of its roles (REST API and dashboard form), any
other role refused with the run's roles named, and another project's run never reachable."""

from __future__ import annotations

import pytest

from webapp.agents.models import Agent

pytestmark = pytest.mark.django_db

ROLES = ["speaker", "listener"]


@pytest.fixture
def roles_run(project, make_run):
    return make_run(project, name="game", lora_rank=8, roles=ROLES)


def test_an_agent_is_created_bound_to_a_role_and_shows_it(api, roles_run):
    body = api.post(
        "/api/v1/agents/",
        {"name": "s", "run": str(roles_run.id), "role": "listener"},
        format="json",
    ).json()
    assert body["role"] == "listener"
    assert api.get(f"/api/v1/agents/{body['id']}/").json()["role"] == "listener"
    assert Agent.objects.get(pk=body["id"]).role == "listener"


def test_a_role_not_in_the_run_is_400_naming_its_roles(api, api_error, roles_run):
    response = api.post(
        "/api/v1/agents/", {"name": "s", "run": str(roles_run.id), "role": "judge"}, format="json"
    )
    error = api_error(response, 400)
    assert "speaker, listener" in " ".join(error["fields"]["role"])
    assert not Agent.objects.exists()


def test_a_role_on_a_run_without_roles_is_400(api, api_error, project, make_run):
    run = make_run(project)
    response = api.post(
        "/api/v1/agents/", {"name": "s", "run": str(run.id), "role": "speaker"}, format="json"
    )
    assert "role" in api_error(response, 400)["fields"]


def test_patch_rebinds_the_role_and_validates_it(api, api_error, roles_run, make_agent, project):
    agent = make_agent(project, run=roles_run)
    response = api.patch(f"/api/v1/agents/{agent.id}/", {"role": "speaker"}, format="json")
    assert response.status_code == 200 and response.json()["role"] == "speaker"
    response = api.patch(f"/api/v1/agents/{agent.id}/", {"role": "judge"}, format="json")
    assert "role" in api_error(response, 400)["fields"]
    agent.refresh_from_db()
    assert agent.role == "speaker"
    # Unbinding the run drops its role with it.
    response = api.patch(f"/api/v1/agents/{agent.id}/", {"run": None}, format="json")
    assert (response.json()["run"], response.json()["role"]) == (None, "")


def test_it_validates_ownership(other_api, api_error, roles_run, make_agent, project):
    # A third user's project names neither this run nor this project's agents.
    response = other_api.post(
        "/api/v1/agents/", {"name": "s", "run": str(roles_run.id), "role": "speaker"}, format="json"
    )
    assert "run" in api_error(response, 400)["fields"]
    agent = make_agent(project, run=roles_run)
    assert (
        other_api.patch(
            f"/api/v1/agents/{agent.id}/", {"role": "speaker"}, format="json"
        ).status_code
        == 404
    )
    agent.refresh_from_db()
    assert agent.role == ""


def test_the_dashboard_form_offers_the_runs_roles(client, owner, project, roles_run):
    client.force_login(owner)
    page = client.get(f"/projects/{project.id}/agents/").content.decode()
    assert 'name="role"' in page and ">listener<" in page
    response = client.post(
        f"/projects/{project.id}/agents/",
        {"name": "heard", "run": str(roles_run.id), "role": "listener"},
    )
    assert response.status_code == 302
    assert Agent.objects.get(name="heard").role == "listener"
