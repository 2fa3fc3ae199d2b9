"""Two projects on one instance: what one tenant's run settings may make the server read, import
and call (``rl_core.sources``, ``webapp.runs.sources``), at every door.

``project`` (B, the owner fixtures' project) trained a run to a checkpoint; ``other_api`` is
another tenant (A) on the same instance, through the REST API only.
"""

from __future__ import annotations

import asyncio
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse

from webapp.runs.jobs import job_secret_issue
from webapp.runs.launching import run_launch
from webapp.runs.models import Checkpoint, Run

pytestmark = pytest.mark.django_db

JUDGE = {"type": "judge", "rubric": "Is it right?", "model": "judge"}


@pytest.fixture
def trained(project, make_run, settings):
    """B's finished run and its checkpoint at step 20, files on disk as a job writes them."""
    run = make_run(project, name="b-run")
    path = settings.DATA_DIR / "runs" / str(run.id) / "checkpoints" / "step_000020"
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(b"weights")
    checkpoint = Checkpoint.objects.create(run=run, version=20, step=20, path=str(path))
    return run, checkpoint


def create(client, **settings_):
    body = {"name": "a-run", "mode": "online", "base_model": "tiny-llama", **settings_}
    return client.post("/api/v1/runs/", body, format="json")


def refusal(response, api_error, field: str) -> str:
    error = api_error(response, 400)
    assert field in error["fields"], error
    return " ".join(error["fields"][field])


# -- each case, refused for the other tenant with a message naming the field -----------------


def test_another_projects_checkpoint_by_id_is_refused_as_an_unknown_one(
    other_api, trained, api_error
):
    _, checkpoint = trained
    theirs = refusal(create(other_api, init_checkpoint=checkpoint.pk), api_error, "init_checkpoint")
    unknown = refusal(create(other_api, init_checkpoint=987654), api_error, "init_checkpoint")
    assert theirs == unknown.replace("987654", str(checkpoint.pk))  # no existence leak
    assert "id of one of this project's checkpoints" in theirs
    assert not Run.objects.filter(name="a-run").exists()


def test_a_checkpoint_path_is_refused_in_init_checkpoint_and_in_base_model(
    other_api, api, trained, api_error
):
    _, checkpoint = trained
    message = refusal(
        create(other_api, init_checkpoint=checkpoint.path), api_error, "init_checkpoint"
    )
    assert "never a path" in message
    # The owner may not name a path either: checkpoints are named by id.
    refusal(create(api, init_checkpoint=checkpoint.path), api_error, "init_checkpoint")
    for who in (other_api, api):
        message = refusal(create(who, base_model=checkpoint.path), api_error, "base_model")
        assert "checkpoint, not a model" in message and "init_checkpoint" in message
    assert not Run.objects.filter(name="a-run").exists()


@pytest.mark.parametrize("name", ["/etc", "/", "/root", "../../etc", "Qwen/Qwen2.5-7B-Instruct"])
def test_a_base_model_the_instance_does_not_offer_is_refused_saying_where_models_come_from(
    other_api, api_error, name
):
    message = refusal(create(other_api, base_model=name), api_error, "base_model")
    assert "GET /api/v1/models/" in message and "STEEP_MODEL_ROOTS" in message


@pytest.mark.parametrize("path", ["os:system", "subprocess:run", "runpy:run_module"])
def test_python_reward_code_the_operator_did_not_allow_is_refused(other_api, api_error, path):
    response = create(other_api, reward={"type": "python", "path": path})
    message = refusal(response, api_error, "reward")
    assert path in message and "STEEP_REWARD_MODULES" in message


@pytest.mark.parametrize(
    "base_url",
    ["http://169.254.169.254/latest", "http://10.0.0.5:8000/v1", "http://[fd00::1]/v1"],
)
def test_a_judge_on_the_private_network_or_metadata_address_is_refused(
    other_api, api_error, base_url
):
    response = create(other_api, reward=JUDGE | {"base_url": base_url})
    message = refusal(response, api_error, "reward")
    assert message.startswith("reward.base_url:") and "STEEP_OUTBOUND_ALLOW" in message


def test_the_loopback_judge_of_the_embedded_default_and_the_operators_allowance(
    other_api, settings, api_error
):
    assert (
        create(other_api, reward=JUDGE | {"base_url": "http://127.0.0.1:9/v1"}).status_code == 201
    )
    settings.STEEP_OUTBOUND_ALLOW = []  # production's default: nothing but global addresses
    response = create(other_api, name="b", reward=JUDGE | {"base_url": "http://127.0.0.1:9/v1"})
    refusal(response, api_error, "reward")
    settings.STEEP_OUTBOUND_ALLOW = ["10.0.0.0/8"]
    response = create(other_api, name="c", reward=JUDGE | {"base_url": "http://10.0.0.5:8000/v1"})
    assert response.status_code == 201


def test_reward_modules_the_operator_lists_are_allowed(other_api, settings, api_error):
    path = "tests.web.tripwire_reward:reward_fn"
    refusal(create(other_api, reward={"type": "python", "path": path}), api_error, "reward")
    settings.STEEP_REWARD_MODULES = ["tests.web"]
    assert create(other_api, reward={"type": "python", "path": path}).status_code == 201
    assert "tests.web.tripwire_reward" not in sys.modules  # checked by name, not imported


# -- B's checkpoint stays usable by B ---------------------------------------------------------


def test_the_owner_starts_from_its_checkpoint_by_id_and_clones_from_it(api, trained):
    run, checkpoint = trained
    response = create(api, init_checkpoint=checkpoint.pk)
    assert response.status_code == 201, response.content
    assert response.json()["config"]["init_checkpoint"] == str(checkpoint.pk)
    clone = api.post(f"/api/v1/runs/{run.id}/clone/", {"from_checkpoint": 20}, format="json")
    assert clone.status_code == 201
    assert clone.json()["config"]["init_checkpoint"] == str(checkpoint.pk)


def test_the_owners_job_is_handed_the_checkpoints_directory(client, api, trained, set_status):
    _, checkpoint = trained
    new = Run.objects.get(pk=create(api, init_checkpoint=str(checkpoint.pk)).json()["id"])
    set_status(new, Run.Status.STARTING)
    secret = job_secret_issue(run=new)
    info = client.get(
        f"/internal/v1/runs/{new.id}/config", HTTP_AUTHORIZATION=f"Bearer {secret}"
    ).json()
    assert info["config"]["init_checkpoint"] == checkpoint.path
    assert info["source_errors"] == {}


def test_another_tenant_cannot_clone_the_run_or_override_a_clone_with_its_checkpoint(
    other_api, other_project, make_run, trained, api_error
):
    run, checkpoint = trained
    api_error(other_api.post(f"/api/v1/runs/{run.id}/clone/", {}, format="json"), 404)
    own = make_run(other_project, name="own")
    response = other_api.post(
        f"/api/v1/runs/{own.id}/clone/",
        {"config": {"init_checkpoint": checkpoint.pk}},
        format="json",
    )
    assert "init_checkpoint" in api_error(response, 400)["fields"]


# -- the dashboard form and the operators' commands ---------------------------------------------


def test_the_dashboard_form_refuses_the_same_settings(outsider_client, other_project, trained):
    from tests.web.test_dashboard_forms import browser_defaults

    _, checkpoint = trained
    url = reverse("dashboard:run-new", args=[other_project.id])
    response = outsider_client.post(url, browser_defaults(base_model="/etc", reward=""))
    assert response.status_code == 400
    assert "STEEP_MODEL_ROOTS" in " ".join(response.context["form"].errors["base_model"])
    reward = '{"type": "python", "path": "os:system"}'
    response = outsider_client.post(url, browser_defaults(reward=reward))
    assert "STEEP_REWARD_MODULES" in " ".join(response.context["form"].errors["reward"])
    response = outsider_client.post(url, browser_defaults(reward="", init_checkpoint=checkpoint.pk))
    assert response.status_code == 400  # not one of the choices this project's form offers
    assert not Run.objects.filter(project=other_project).exists()


def test_pool_create_refuses_a_model_unless_the_operator_bypasses_it_explicitly(db):
    with pytest.raises(CommandError, match="STEEP_MODEL_ROOTS"):
        call_command("pool_create", "odd", "--model", "/etc", "--no-start", stdout=StringIO())
    out = StringIO()
    call_command(
        "pool_create", "odd", "--model", "/etc", "--no-start", "--unrestricted", stdout=out
    )
    assert "Pool odd: /etc" in out.getvalue()


# -- a run written before the rules is refused when it runs, before anything is imported -----


def _legacy_run(project, checkpoint) -> Run:
    """A run whose config was written straight to the database, as before the rules."""
    return Run.objects.create(
        project=project,
        name="legacy",
        mode="online",
        base_model="/etc",
        config={
            "mode": "online",
            "base_model": "/etc",
            "init_checkpoint": checkpoint.path,
            "reward": {"type": "python", "path": "tests.web.tripwire_reward:reward_fn"},
        },
    )


def test_a_run_created_before_the_rules_fails_at_launch_with_the_same_messages(
    other_api, other_project, trained, api_error, monkeypatch
):
    from webapp.runs import launching

    def no_cluster():
        raise AssertionError("the launch reached the Ray cluster")

    monkeypatch.setattr(launching, "steep_cluster", no_cluster)
    _, checkpoint = trained
    legacy = _legacy_run(other_project, checkpoint)
    assert other_api.post(f"/api/v1/runs/{legacy.id}/start/").status_code == 202
    assert run_launch(run_id=str(legacy.id)) == "failed"
    legacy.refresh_from_db()
    assert legacy.status == Run.Status.FAILED and not legacy.job_id  # no job was submitted
    # The messages creation gives for the same settings, each naming its field.
    for field, value in [
        ("base_model", "/etc"),
        ("reward", {"type": "python", "path": "tests.web.tripwire_reward:reward_fn"}),
    ]:
        assert refusal(create(other_api, **{field: value}), api_error, field) in legacy.error
    assert "init_checkpoint" in legacy.error and "No checkpoint" in legacy.error
    assert checkpoint.path not in legacy.error.split("No checkpoint", 1)[0]
    assert "tests.web.tripwire_reward" not in sys.modules


def test_the_owners_legacy_path_still_resolves_to_its_own_checkpoint(project, trained):
    from webapp.runs.sources import run_sourced

    run, checkpoint = trained
    legacy = Run.objects.create(
        project=project,
        name="own-legacy",
        mode="online",
        base_model=run.base_model,
        config=run.config | {"init_checkpoint": checkpoint.path},
    )
    config, errors = run_sourced(run=legacy)
    assert errors == {} and config["init_checkpoint"] == checkpoint.path


def test_the_job_refuses_what_the_web_app_refused_before_reading_anything(
    other_project, trained, monkeypatch
):
    """The Ray job's own start: it fails the run with the refusal and imports nothing."""
    import workers.ray_job as ray_job
    from webapp.runs.sources import run_sourced, source_rules

    _, checkpoint = trained
    legacy = _legacy_run(other_project, checkpoint)
    config, refused = run_sourced(run=legacy)
    reported: list[tuple] = []

    class API:
        def __init__(self, *args):
            pass

        async def config(self):
            # An old web app that sends no verdict: the job applies the rules itself.
            return {"config": config, "sources": source_rules().to_dict()}

        async def release(self):
            pass

        async def status(self, status, **kwargs):
            reported.append((status, kwargs))

        async def aclose(self):
            pass

    monkeypatch.setattr(ray_job, "InternalAPI", API)
    with pytest.raises(ray_job.SourcesRefused):
        asyncio.run(ray_job.run_job(str(legacy.id), "http://127.0.0.1:9", "secret"))
    ((status, kwargs),) = reported
    assert status == "failed"
    assert refused["base_model"][0] in kwargs["error"] and "STEEP_REWARD_MODULES" in kwargs["error"]
    assert "Traceback" not in kwargs["error"]
    assert "tests.web.tripwire_reward" not in sys.modules


def test_an_eval_of_a_run_written_before_the_rules_fails_without_importing_its_reward(
    other_project, trained, make_dataset
):
    from webapp.evals.executing import eval_execute
    from webapp.evals.models import Eval

    _, checkpoint = trained
    legacy = _legacy_run(other_project, checkpoint)
    dataset = make_dataset(other_project, name="rows")
    evaluation = Eval.objects.create(
        project=other_project, run=legacy, dataset=dataset, k=1, pass_threshold=1.0,
        max_new_tokens=4, temperature=1.0,
    )  # fmt: skip
    assert eval_execute(eval_id=evaluation.pk) == "failed"
    evaluation.refresh_from_db()
    assert "STEEP_REWARD_MODULES" in evaluation.error and "base_model" in evaluation.error
    assert "tests.web.tripwire_reward" not in sys.modules


def test_cloning_a_run_written_before_ids_names_its_own_checkpoint_by_id(
    api, other_api, project, other_project, trained, api_error
):
    run, checkpoint = trained
    own = Run.objects.create(
        project=project,
        name="own-legacy",
        mode="online",
        base_model=run.base_model,
        config=run.config | {"init_checkpoint": checkpoint.path},
    )
    clone = api.post(f"/api/v1/runs/{own.id}/clone/", {}, format="json")
    assert clone.status_code == 201, clone.content
    assert clone.json()["config"]["init_checkpoint"] == str(checkpoint.pk)
    theirs = Run.objects.create(
        project=other_project,
        name="their-legacy",
        mode="online",
        base_model=run.base_model,
        config=run.config | {"init_checkpoint": checkpoint.path},
    )
    response = other_api.post(f"/api/v1/runs/{theirs.id}/clone/", {}, format="json")
    assert "No checkpoint" in " ".join(api_error(response, 400)["fields"]["init_checkpoint"])
