"""Every REST endpoint is scoped by project: another project's objects are 404, never 403, never data."""

from __future__ import annotations

import re
import uuid
from types import SimpleNamespace

import pytest
from django.urls import URLPattern

from webapp.accounts.models import APIKey
from webapp.accounts.services import api_key_create
from webapp.agents.models import Agent
from webapp.agents.services import AgentInvalid, agent_bind_run, agent_create
from webapp.api import urls as api_urls
from webapp.datasets.models import Dataset
from webapp.evals.models import Eval
from webapp.gateway.models import Session
from webapp.runs.models import Checkpoint, MetricPoint, Run
from webapp.runs.services import RunInvalid, run_create

pytestmark = pytest.mark.django_db

# (route in webapp/api/urls.py, method, which object fills the id, owner's status)
DETAIL_REQUESTS = [
    ("datasets/<str:dataset_id>/", "get", "dataset", 200),
    ("datasets/<str:dataset_id>/", "delete", "spare_dataset", 204),
    ("runs/<str:run_id>/", "get", "run", 200),
    ("runs/<str:run_id>/", "delete", "run", 204),
    ("runs/<str:run_id>/start/", "post", "run", 202),
    ("runs/<str:run_id>/stop/", "post", "queued_run", 202),
    ("runs/<str:run_id>/clone/", "post", "run", 201),
    ("runs/<str:run_id>/ledger/", "get", "run", 200),
    ("runs/<str:run_id>/metrics/", "get", "run", 200),
    ("runs/<str:run_id>/checkpoints/", "get", "run", 200),
    ("runs/<str:run_id>/checkpoints/<str:checkpoint_id>/", "get", "checkpoint", 200),
    # The owner's answer: the victim's checkpoint files do not exist, so nothing to export.
    ("runs/<str:run_id>/checkpoints/<str:checkpoint_id>/export/", "post", "checkpoint", 409),
    ("runs/<str:run_id>/trajectories.jsonl", "get", "run", 200),
    ("runs/<str:run_id>/trajectories/export", "get", "run", 200),
    ("runs/<str:run_id>/trajectories/export/", "get", "run", 200),
    # The owner's answer: the victim's checkpoint was never exported, so no folder to zip.
    ("runs/<str:run_id>/checkpoints/<str:checkpoint_id>/download/", "get", "checkpoint", 409),
    ("runs/<str:run_id>/evals/", "get", "run", 200),
    # The owner's answer to an empty body: name a model to evaluate.
    ("runs/<str:run_id>/evals/", "post", "run", 409),
    ("runs/<str:run_id>/evals/<str:eval_id>/", "get", "evaluation", 200),
    ("runs/<str:run_id>/evals/<str:eval_id>/examples/", "get", "evaluation", 200),
    ("agents/<str:agent_id>/", "get", "agent", 200),
    ("agents/<str:agent_id>/", "patch", "agent", 200),
    ("agents/<str:agent_id>/", "delete", "agent", 204),
    ("sessions/<str:session_id>/", "get", "session", 200),
    # The owner's answer to an empty body: feedback that says nothing (the view was reached).
    ("sessions/<str:session_id>/feedback/", "post", "session", 400),
    ("sessions/<str:session_id>/feedback/", "get", "session", 200),
    ("keys/<str:key_id>/", "delete", "key", 200),
    ("keys/<str:key_id>/revoke/", "post", "key", 200),
]
LISTS = ["datasets", "runs", "agents", "keys", "sessions"]
# Pools belong to the platform, not to a project: staff only, and a project key gets 404 on
# every pool route (tests/pools/test_pools_api.py).
STAFF_ONLY_PREFIXES = ("pools/",)
SECRETS = [
    "secret-dataset",
    "spare-dataset",
    "secret-run",
    "queued-run",
    "secret-agent",
    "hidden",
    "secret-task",
]


def path_for(route: str, obj) -> str:
    def fill(param: re.Match) -> str:
        # A checkpoint's and an eval's routes name its run too.
        if param.group(1) == "run_id" and isinstance(obj, Checkpoint | Eval):
            return str(obj.run_id)
        return str(obj.id)

    return "/api/v1/" + re.sub(r"<str:(\w+)>", fill, route)


@pytest.fixture
def victim(project, make_dataset, make_run, make_agent, set_status):
    """``project``'s objects, which ``other_api`` (another project's key) goes after."""
    dataset = make_dataset(project, name="secret-dataset")
    run = make_run(project, name="secret-run", dataset=dataset)
    MetricPoint.objects.create(run=run, step=1, name="loss", value=0.5)
    checkpoint = Checkpoint.objects.create(run=run, version=1, step=1, path="/ckpt/secret-run/v1")
    key, _ = api_key_create(project=project, name="hidden")
    agent = make_agent(project, name="secret-agent", run=run)
    return SimpleNamespace(
        dataset=dataset,
        spare_dataset=make_dataset(project, name="spare-dataset"),
        run=run,
        checkpoint=checkpoint,
        evaluation=Eval.objects.create(
            project=project,
            run=run,
            dataset=dataset,
            k=1,
            pass_threshold=1.0,
            max_new_tokens=4,
            temperature=1.0,
        ),  # fmt: skip
        queued_run=set_status(make_run(project, name="queued-run"), Run.Status.QUEUED),
        agent=agent,
        key=key,
        session=Session.objects.create(
            project=project, agent=agent, run=run, task_id="secret-task"
        ),
    )


def api_routes() -> list[tuple[str, str]]:
    """Every (route in webapp/api/urls.py, method its view answers), staff-only routes left out."""
    found = []
    for pattern in api_urls.urlpatterns:
        assert isinstance(pattern, URLPattern)
        route = str(pattern.pattern)
        if route.startswith(STAFF_ONLY_PREFIXES):
            continue
        view = pattern.callback.view_class
        found += [(route, m) for m in ("get", "post", "put", "patch", "delete") if hasattr(view, m)]
    return found


def test_every_detail_endpoint_and_method_is_covered_here():
    covered = {(route, method) for route, method, _, _ in DETAIL_REQUESTS}
    assert {(route, method) for route, method in api_routes() if "<" in route} == covered


@pytest.mark.parametrize(
    "route,method,target,owner_status",
    DETAIL_REQUESTS,
    ids=[f"{m} {r}" for r, m, _, _ in DETAIL_REQUESTS],
)
def test_other_projects_key_gets_404_and_changes_nothing(
    api, other_api, victim, api_error, route, method, target, owner_status
):
    path = path_for(route, getattr(victim, target))
    response = getattr(other_api, method)(path)
    error = api_error(response, 404)
    assert error["code"] == "not_found"
    body = response.content.decode()
    assert not any(secret in body for secret in SECRETS)
    assert str(getattr(victim, target).id) not in body

    assert Dataset.objects.filter(pk=victim.dataset.pk).exists()
    assert Dataset.objects.filter(pk=victim.spare_dataset.pk).exists()
    assert victim.spare_dataset.path.exists()
    assert Run.objects.get(pk=victim.run.pk).status == Run.Status.DRAFT
    assert Run.objects.get(pk=victim.queued_run.pk).status == Run.Status.QUEUED
    assert Agent.objects.filter(pk=victim.agent.pk).exists()
    assert APIKey.objects.get(pk=victim.key.pk).revoked_at is None
    assert Session.objects.filter(pk=victim.session.pk).exists()
    assert Checkpoint.objects.get(pk=victim.checkpoint.pk).export_status == "none"

    # The owner reaches the same URL: the 404 above is about ownership, not a bad path.
    assert getattr(api, method)(path).status_code == owner_status


@pytest.mark.parametrize("name", LISTS)
def test_lists_never_include_other_projects_objects(api, other_api, victim, name):
    theirs = other_api.get(f"/api/v1/{name}/")
    assert theirs.status_code == 200
    body = theirs.content.decode()
    for obj in vars(victim).values():
        if isinstance(obj, Checkpoint):
            continue  # a small integer id, found in any body; listed only under its run
        assert str(obj.id) not in body
    assert not any(secret in body for secret in SECRETS)

    mine = {row["id"] for row in api.get(f"/api/v1/{name}/").json()["results"]}
    assert mine & {str(obj.id) for obj in vars(victim).values()}


def test_filtered_lists_never_include_other_projects_objects(other_api, victim):
    for status in Run.Status.values:
        assert other_api.get(f"/api/v1/runs/?status={status}").json()["count"] == 0
    assert other_api.get(f"/api/v1/agents/?run={victim.run.id}").json()["count"] == 0
    assert other_api.get(f"/api/v1/sessions/?run={victim.run.id}").json()["count"] == 0
    assert other_api.get(f"/api/v1/sessions/?agent={victim.agent.id}").json()["count"] == 0


def test_project_endpoint_answers_the_keys_own_project(api, other_api, project, other_project):
    assert api.get("/api/v1/project/").json()["id"] == str(project.id)
    assert other_api.get("/api/v1/project/").json()["id"] == str(other_project.id)


def test_creating_a_run_with_another_projects_dataset_is_400_not_found(
    other_api, victim, api_error
):
    response = other_api.post(
        "/api/v1/runs/",
        {
            "name": "stolen",
            "mode": "dataset",
            "base_model": "tiny-llama",
            "reward": {"type": "exact_match"},
            "dataset": str(victim.dataset.id),
        },
        format="json",
    )
    error = api_error(response, 400)
    assert "not found" in " ".join(error["fields"]["dataset"]).lower()
    assert not Run.objects.filter(name="stolen").exists()


def test_creating_an_agent_with_another_projects_run_is_400(other_api, victim, api_error):
    response = other_api.post(
        "/api/v1/agents/", {"name": "stolen", "run": str(victim.run.id)}, format="json"
    )
    error = api_error(response, 400)
    assert "not found" in " ".join(error["fields"]["run"]).lower()
    assert not Agent.objects.filter(name="stolen").exists()


def test_services_refuse_another_projects_dataset_and_run(other_project, victim):
    from rl_core.config import RunConfig

    config = RunConfig.from_dict(
        {"base_model": "m", "mode": "dataset", "reward": {"type": "exact_match"}}
    )
    with pytest.raises(RunInvalid) as raised:
        run_create(project=other_project, name="stolen", config=config, dataset=victim.dataset)
    assert "dataset" in raised.value.errors
    with pytest.raises(AgentInvalid):
        agent_create(project=other_project, name="stolen", run=victim.run)
    own = agent_create(project=other_project, name="own")
    with pytest.raises(AgentInvalid):
        agent_bind_run(agent=own, run=victim.run)
    own.refresh_from_db()
    assert own.run_id is None


BAD_IDS = ["not-a-uuid", "123", "0" * 33, "%27%3B--", "None", str(uuid.uuid4())]


@pytest.mark.parametrize(
    "route,method",
    sorted({(route, method) for route, method, _, _ in DETAIL_REQUESTS}),
)
def test_malformed_or_unknown_ids_are_404_json(api, api_error, route, method):
    for bad_id in BAD_IDS:
        path = "/api/v1/" + re.sub(r"<str:\w+>", bad_id, route)
        assert api_error(getattr(api, method)(path), 404)["code"] == "not_found", path


def test_logged_in_non_member_naming_the_project_is_404(
    outsider_client, member_client, project, api_error
):
    header = {"HTTP_X_STEEP_PROJECT": str(project.id)}
    for path in ("/api/v1/project/", "/api/v1/runs/", "/api/v1/keys/"):
        api_error(outsider_client.get(path, **header), 404)
        assert member_client.get(path, **header).status_code == 200
    assert outsider_client.get(f"/api/v1/runs/?project={project.id}").status_code == 404


def test_logged_in_user_without_a_project_is_asked_to_name_one(member_client, api_error):
    error = api_error(member_client.get("/api/v1/runs/"), 400)
    assert "project" in error["fields"]


# The settings that make the server read something, filled with another tenant's values, at
# every door that takes run settings (each case in full: tests/web/test_tenant_sources.py).
SETTINGS_DOORS = [("runs/", "post"), ("runs/<str:run_id>/clone/", "post")]


def _their_settings(victim) -> list[tuple[str, object, object]]:
    """(setting, the victim's value, a value that names nothing) pairs."""
    return [
        ("init_checkpoint", victim.checkpoint.pk, 987654),
        ("init_checkpoint", str(victim.checkpoint.pk), "987654"),
        ("init_checkpoint", victim.checkpoint.path, "/ckpt/nothing/v1"),
        ("base_model", victim.checkpoint.path, "/ckpt/nothing/v1"),
    ]


def test_the_doors_that_take_run_settings_are_api_routes():
    assert set(SETTINGS_DOORS) <= set(api_routes())


@pytest.mark.parametrize("route,method", SETTINGS_DOORS)
def test_settings_naming_another_projects_things_are_400_like_names_of_nothing(
    other_api, other_project, make_run, victim, api_error, route, method
):
    own = make_run(other_project, name="own")
    for setting, theirs, nothing in _their_settings(victim):

        def attempt(value, setting=setting):
            if route == "runs/":
                body = {"name": "stolen", "mode": "online", "base_model": "m", setting: value}
            else:
                body = {"name": "stolen", "config": {setting: value}}
            response = getattr(other_api, method)(path_for(route, own), body, format="json")
            return " ".join(api_error(response, 400)["fields"][setting])

        their_answer = attempt(theirs)
        assert their_answer == attempt(nothing).replace(str(nothing), str(theirs)), setting
        assert not Run.objects.filter(name="stolen").exists()
