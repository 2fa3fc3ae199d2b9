"""Agents: created in a project (optionally on one of its runs) and handed a base_url."""

from __future__ import annotations

import pytest

from webapp.agents.models import Agent

pytestmark = pytest.mark.django_db


def test_create_returns_a_base_url_under_site_url(api, settings, project):
    response = api.post("/api/v1/agents/", {"name": "solver"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["name"] == "solver" and body["run"] is None
    assert body["base_url"] == f"{settings.SITE_URL}/agents/{body['id']}/v1"
    assert Agent.objects.get(pk=body["id"]).project == project


def test_create_on_a_run_of_the_project(api, project, make_run):
    run = make_run(project)
    body = api.post("/api/v1/agents/", {"name": "s", "run": str(run.id)}, format="json").json()
    assert body["run"] == str(run.id)
    listed = api.get(f"/api/v1/agents/?run={run.id}").json()
    assert [a["id"] for a in listed["results"]] == [body["id"]]


def test_unknown_run_is_400(api, api_error):
    error = api_error(
        api.post(
            "/api/v1/agents/",
            {"name": "s", "run": "00000000-0000-0000-0000-000000000000"},
            format="json",
        ),
        400,
    )
    assert "run" in error["fields"]
    assert not Agent.objects.exists()


def test_detail_and_delete(api, project, make_agent):
    agent = make_agent(project, name="x")
    assert api.get(f"/api/v1/agents/{agent.id}/").json()["base_url"] == agent.base_url
    assert api.delete(f"/api/v1/agents/{agent.id}/").status_code == 204
    assert not Agent.objects.filter(pk=agent.pk).exists()


def test_deleting_its_run_leaves_the_agent_unbound(api, project, make_run, make_agent):
    run = make_run(project)
    agent = make_agent(project, run=run)
    assert api.delete(f"/api/v1/runs/{run.id}/").status_code == 204
    agent.refresh_from_db()
    assert agent.run is None
