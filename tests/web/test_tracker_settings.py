"""A run's experiment trackers in the web app: credentials sealed at rest and never shown, the
instance default under the run's setting, what the job is handed, and the run page's notice."""

from __future__ import annotations

import json

import pytest

from webapp.rewards.secrets import REDACTED
from webapp.runs.jobs import job_secret_issue
from webapp.runs.models import Run, RunEvent
from webapp.runs.trackers import job_trackers

WANDB_KEY = "wandb-key-0123456789abcdef0123456789abcdef"
MLFLOW_TOKEN = "mlflow-token-s3cret"
TRACKERS = {
    "wandb": {"project": "letters", "api_key": WANDB_KEY},
    "mlflow": {"tracking_uri": "https://mlflow.example.com", "tracking_token": MLFLOW_TOKEN},
    "tensorboard": {},
}


@pytest.fixture
def tracked_run(api, project):
    response = api.post(
        "/api/v1/runs/",
        data={
            "name": "tracked",
            "mode": "online",
            "base_model": "tiny-llama",
            "trackers": TRACKERS,
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    return Run.objects.get(pk=response.json()["id"])


def job_config(client, run) -> dict:
    secret = job_secret_issue(run=run)
    response = client.get(
        f"/internal/v1/runs/{run.id}/config", HTTP_AUTHORIZATION=f"Bearer {secret}"
    )
    assert response.status_code == 200
    return response.json()


def test_tracker_credentials_are_stored_encrypted_and_never_shown(
    tracked_run, api, member_client, project
):
    stored = json.dumps(Run.objects.get(pk=tracked_run.pk).config)
    assert WANDB_KEY not in stored and MLFLOW_TOKEN not in stored
    ciphertexts = [
        tracked_run.config["trackers"]["wandb"]["api_key_encrypted"],
        tracked_run.config["trackers"]["mlflow"]["tracking_token_encrypted"],
    ]
    body = api.get(f"/api/v1/runs/{tracked_run.id}/").content.decode()
    page = member_client.get(f"/projects/{project.id}/runs/{tracked_run.id}/").content.decode()
    for shown in (body, page):
        for secret in (WANDB_KEY, MLFLOW_TOKEN, *ciphertexts):
            assert secret not in shown
        assert REDACTED in shown
    shown_trackers = api.get(f"/api/v1/runs/{tracked_run.id}/").json()["config"]["trackers"]
    assert shown_trackers["wandb"] == {"project": "letters", "api_key": REDACTED}


def test_the_job_alone_is_handed_the_credentials_in_plain_text(tracked_run, client):
    handed = job_config(client, tracked_run)["trackers"]

    assert handed == {
        "wandb": {"project": "letters", "api_key": WANDB_KEY},
        "mlflow": {"tracking_uri": "https://mlflow.example.com", "tracking_token": MLFLOW_TOKEN},
        "tensorboard": {},
    }


def test_a_run_cannot_name_an_mlflow_store_on_the_servers_disk(api, api_error):
    for uri in ("file:///etc/steep", "/tmp/mlruns", "sqlite:////tmp/x.db"):
        body = {
            "name": "r",
            "mode": "online",
            "base_model": "tiny-llama",
            "trackers": {"mlflow": {"tracking_uri": uri}},
        }
        error = api_error(api.post("/api/v1/runs/", data=body, format="json"), 400)
        assert "STEEP_TRACKERS" in json.dumps(error)


def test_an_unknown_tracker_or_option_is_a_400_naming_what_is_allowed(api, api_error):
    for trackers, says in (
        ({"comet": {}}, "use wandb, mlflow, tensorboard"),
        ({"wandb": {"projct": "x"}}, "its options: project"),
        ({"wandb": {"mode": "shared"}}, "online or offline"),
    ):
        body = {"name": "r", "mode": "online", "base_model": "tiny-llama", "trackers": trackers}
        error = api_error(api.post("/api/v1/runs/", data=body, format="json"), 400)
        assert says in json.dumps(error)


def test_the_instance_default_applies_under_the_runs_own_setting(
    project, make_run, settings, client
):
    settings.STEEP_TRACKERS = {"tensorboard": {}, "wandb": {"project": "everything"}}
    settings.STEEP_WANDB_API_KEY = "instance-wandb-key"
    plain = make_run(project, name="plain")
    opted_out = make_run(project, name="no-wandb", trackers={"wandb": False})
    renamed = make_run(project, name="own", trackers={"wandb": {"project": "mine"}})

    assert job_trackers(plain) == {
        "wandb": {"project": "everything", "api_key": "instance-wandb-key"},
        "tensorboard": {},
    }
    assert job_trackers(opted_out) == {"tensorboard": {}}
    assert job_trackers(renamed)["wandb"] == {"project": "mine", "api_key": "instance-wandb-key"}


def test_a_bad_steep_trackers_fails_at_start_saying_why():
    from rl_core.tracker_specs import parse_instance_trackers

    assert parse_instance_trackers("tensorboard, mlflow") == {"tensorboard": {}, "mlflow": {}}
    assert parse_instance_trackers('{"mlflow": {"tracking_uri": "file:///srv/mlruns"}}')
    with pytest.raises(ValueError, match="Unknown tracker 'neptune'"):
        parse_instance_trackers("neptune")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_instance_trackers("{mlflow")


def test_the_run_page_says_which_trackers_mirror_it_and_which_stopped(
    project, make_run, member_client
):
    run = make_run(project, trackers={"tensorboard": {}, "mlflow": {}})
    RunEvent.objects.create(
        run=run,
        kind="tracker",
        message="MLflow: stopped mirroring this run at the start (MlflowException: no). "
        "The run goes on without it.",
    )
    untracked = make_run(project, name="untracked")

    page = member_client.get(f"/projects/{project.id}/runs/{run.id}/").content.decode()
    plain = member_client.get(f"/projects/{project.id}/runs/{untracked.id}/").content.decode()

    assert 'id="run-trackers"' in page and "TensorBoard" in page
    assert "MLflow: stopped mirroring this run at the start" in page
    assert 'id="run-trackers"' not in plain


def test_it_validates_ownership_another_project_cannot_see_a_runs_trackers(
    tracked_run, other_api, outsider_client, project
):
    assert other_api.get(f"/api/v1/runs/{tracked_run.id}/").status_code == 404
    page = outsider_client.get(f"/projects/{project.id}/runs/{tracked_run.id}/")
    assert page.status_code == 404


def test_the_job_reads_its_finished_evaluations_for_its_trackers(
    project, make_run, make_dataset, client
):
    from webapp.evals.models import Eval

    dataset = make_dataset(project)
    run = make_run(project, dataset=dataset, trackers={"tensorboard": {}})
    common = {"project": project, "run": run, "dataset": dataset, "k": 2, "pass_threshold": 1.0}
    common |= {"max_new_tokens": 8, "temperature": 1.0}
    done = Eval.objects.create(
        **common, step=5, status="done", examples=4, mean_reward=0.5, pass_at_k=0.75
    )
    Eval.objects.create(**common, step=10, status="running")
    secret = job_secret_issue(run=run)

    response = client.get(
        f"/internal/v1/runs/{run.id}/evals", HTTP_AUTHORIZATION=f"Bearer {secret}"
    )

    assert response.json() == {
        "evals": [
            {
                "id": str(done.id),
                "step": 5,
                "values": {"examples": 4.0, "mean_reward": 0.5, "pass_at_k": 0.75},
            }
        ]
    }


def test_the_run_form_takes_trackers_as_json_and_seals_the_key(member_client, project, model_named):
    from django.urls import reverse

    from tests.web.test_dashboard_forms import browser_defaults

    url = reverse("dashboard:run-new", args=[project.id])
    data = browser_defaults(reward="", trackers=json.dumps({"wandb": {"api_key": WANDB_KEY}}))
    assert member_client.post(url, data).status_code == 302
    run = Run.objects.get(project=project)
    assert WANDB_KEY not in json.dumps(run.config)
    assert "api_key_encrypted" in run.config["trackers"]["wandb"]

    bad = member_client.post(url, browser_defaults(reward="", trackers="{wandb"))
    assert "Enter a JSON object" in bad.content.decode()
