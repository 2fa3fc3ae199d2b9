"""Every dashboard page renders for a member, sends strangers to log in, and 404s for non-members."""

from __future__ import annotations

import re
from html import unescape
from types import SimpleNamespace

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db


@pytest.fixture
def objects(project, make_dataset, make_run, make_agent):
    dataset = make_dataset(project, name="gsm-mini")
    run = make_run(project, name="first-run", dataset=dataset)
    return SimpleNamespace(
        project=project, dataset=dataset, run=run, agent=make_agent(project, name="bot", run=run)
    )


PAGES = {
    "projects": lambda o: reverse("dashboard:projects"),
    "runs": lambda o: reverse("dashboard:runs", args=[o.project.id]),
    "run-new": lambda o: reverse("dashboard:run-new", args=[o.project.id]),
    "run": lambda o: reverse("dashboard:run", args=[o.project.id, o.run.id]),
    "agents": lambda o: reverse("dashboard:agents", args=[o.project.id]),
    "agent": lambda o: reverse("dashboard:agent", args=[o.project.id, o.agent.id]),
    "datasets": lambda o: reverse("dashboard:datasets", args=[o.project.id]),
    "dataset": lambda o: reverse("dashboard:dataset", args=[o.project.id, o.dataset.id]),
    "keys": lambda o: reverse("dashboard:keys", args=[o.project.id]),
}
PROJECT_PAGES = [name for name in PAGES if name != "projects"]
SHOWS = {
    "projects": "acme",
    "runs": "first-run",
    "run-new": "max_staleness",
    "run": "first-run",
    "agents": "bot",
    "agent": "/v1",
    "datasets": "gsm-mini",
    "dataset": "What is 2 + 2?",
    "keys": "New key",
}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_for_a_member(member_client, objects, page):
    response = member_client.get(PAGES[page](objects))
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" in html
    assert SHOWS[page] in html


@pytest.mark.parametrize("page", PAGES)
def test_logged_out_visitor_is_sent_to_log_in(client, objects, page):
    url = PAGES[page](objects)
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"{reverse('dashboard:login')}?next={url}"


@pytest.mark.parametrize("page", PROJECT_PAGES)
def test_non_member_gets_404(outsider_client, objects, page):
    response = outsider_client.get(PAGES[page](objects))
    assert response.status_code == 404
    assert b"first-run" not in response.content and b"gsm-mini" not in response.content


def test_projects_page_lists_only_my_projects(outsider_client, objects, other_project):
    html = outsider_client.get(reverse("dashboard:projects")).content.decode()
    assert other_project.name in html and "acme" not in html


def test_my_project_url_with_another_projects_object_is_404(
    member_client, project, other_project, make_dataset, make_run, make_agent
):
    theirs_dataset = make_dataset(other_project)
    theirs_run = make_run(other_project)
    theirs_agent = make_agent(other_project)
    for url in (
        reverse("dashboard:run", args=[project.id, theirs_run.id]),
        reverse("dashboard:agent", args=[project.id, theirs_agent.id]),
        reverse("dashboard:dataset", args=[project.id, theirs_dataset.id]),
        reverse("dashboard:run", args=[project.id, "not-a-uuid"]),
        reverse("dashboard:runs", args=["not-a-uuid"]),
    ):
        assert member_client.get(url).status_code == 404, url


def test_agent_page_shows_base_url_and_a_snippet_using_it(member_client, objects, settings):
    html = unescape(member_client.get(PAGES["agent"](objects)).content.decode())
    base_url = f"{settings.SITE_URL}/agents/{objects.agent.id}/v1"
    assert objects.agent.base_url == base_url
    snippets = [block for block in re.findall(r"<pre[^>]*>(.*?)</pre>", html, re.S)]
    assert any("from openai import OpenAI" in s and f'"{base_url}"' in s for s in snippets)
    assert html.count(base_url) >= 2  # the copy field and the snippet


def test_run_page_shows_metrics_checkpoints_and_history(member_client, objects):
    from webapp.runs.models import Checkpoint, MetricPoint

    MetricPoint.objects.create(run=objects.run, step=3, name="rollout/reward", value=0.75)
    Checkpoint.objects.create(run=objects.run, version=2, step=3, path="/ckpt")
    html = member_client.get(PAGES["run"](objects)).content.decode()
    assert "rollout/reward" in html and "0.7500" in html
    assert "created" in html  # the history
    assert ">v2<" in html  # checkpoint version


def test_project_root_redirects_to_its_runs(member_client, outsider_client, project):
    url = reverse("dashboard:project", args=[project.id])
    response = member_client.get(url)
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:runs", args=[project.id])
    assert outsider_client.get(url).status_code == 404


def test_creating_a_project_makes_me_its_owner(member_client, owner):
    from webapp.accounts.models import Membership, Project

    response = member_client.post(reverse("dashboard:projects"), {"name": "new-one"})
    project = Project.objects.get(name="new-one")
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:runs", args=[project.id])
    assert Membership.objects.get(project=project, user=owner).role == "owner"


def test_a_taken_project_name_is_an_inline_error(member_client, project):
    response = member_client.post(reverse("dashboard:projects"), {"name": project.name})
    assert response.status_code == 200
    assert "already exists" in response.content.decode()


def test_login_page_renders(client):
    assert client.get(reverse("dashboard:login")).status_code == 200


def test_favicon_is_served_for_every_page(client, member_client, objects):
    response = client.get("/favicon.ico")
    assert response.status_code == 301
    icon = client.get(response["Location"])
    assert icon.status_code == 200 and icon["Content-Type"] == "image/svg+xml"
    assert b"<svg" in b"".join(icon.streaming_content)
    html = member_client.get(PAGES["run"](objects)).content.decode()
    assert f'<link rel="icon" href="{response["Location"]}" type="image/svg+xml">' in html
