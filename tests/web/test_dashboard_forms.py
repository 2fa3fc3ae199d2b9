"""Dashboard forms: keys shown once, uploads and runs validated with errors inline, nothing half-stored."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from webapp.accounts.models import APIKey
from webapp.accounts.services import api_key_create
from webapp.dashboard.forms import RunForm
from webapp.datasets.models import Dataset
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db


# --- keys -----------------------------------------------------------------------------------


def test_key_created_in_the_dashboard_is_shown_once(member_client, project, anon_api):
    url = reverse("dashboard:keys", args=[project.id])
    response = member_client.post(url, {"name": "laptop"})
    assert response.status_code == 200
    key = APIKey.objects.get(project=project, name="laptop")
    html = response.content.decode()
    plaintext = html.split('<code id="new-key-value">')[1].split("</code>")[0]
    assert plaintext.startswith("sk-steep-")
    assert hashlib.sha256(plaintext.encode()).hexdigest() == key.hashed

    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert anon_api.get("/api/v1/project/").json()["id"] == str(project.id)

    again = member_client.get(url).content.decode()
    assert plaintext not in again
    assert key.prefix in again and 'id="new-key-value"' not in again


def test_key_revoked_in_the_dashboard_stops_working(member_client, project, anon_api):
    key, plaintext = api_key_create(project=project, name="old")
    response = member_client.post(reverse("dashboard:key-revoke", args=[project.id, key.id]))
    assert response.status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert anon_api.get("/api/v1/project/").status_code == 401


def test_it_validates_ownership_of_keys(outsider_client, project):
    key, _ = api_key_create(project=project)
    url = reverse("dashboard:key-revoke", args=[project.id, key.id])
    assert outsider_client.post(url).status_code == 404
    assert outsider_client.post(reverse("dashboard:keys", args=[project.id])).status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None
    assert APIKey.objects.filter(project=project).count() == 1


# --- datasets -------------------------------------------------------------------------------


def upload(client, project, content: bytes, name: str = "prompts", headers=None):
    return client.post(
        reverse("dashboard:datasets", args=[project.id]),
        {"name": name, "file": SimpleUploadedFile("data.jsonl", content)},
        headers=headers or {},
    )


def stored_files(settings, project) -> list[str]:
    directory = Path(settings.DATA_DIR) / "datasets" / str(project.id)
    return sorted(os.listdir(directory)) if directory.exists() else []


def test_good_upload_redirects_to_the_dataset(member_client, project, jsonl, sample_rows):
    response = upload(member_client, project, jsonl(sample_rows))
    dataset = Dataset.objects.get(project=project)
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:dataset", args=[project.id, dataset.id])
    assert dataset.row_count == 2
    assert "Uploaded 2 rows" in member_client.get(response["Location"]).content.decode()


def test_upload_errors_appear_inline_with_line_numbers_and_nothing_is_stored(
    member_client, project, settings
):
    content = b'{"prompt": "ok"}\n{broken\n{"prompt": 3}\n' + b"nope\n" * 30
    response = upload(member_client, project, content)
    assert response.status_code == 400
    html = response.content.decode()
    assert "<html" in html
    assert "line 2: not valid JSON" in html
    assert "line 3: &quot;prompt&quot; must be a non-empty string" in html
    assert "line 21:" in html and "line 22:" not in html
    assert "12 more invalid line(s)" in html
    assert "Nothing was stored" in html
    assert not Dataset.objects.exists()
    assert stored_files(settings, project) == []


def test_upload_errors_come_back_as_the_panel_for_htmx(member_client, project, settings):
    response = upload(member_client, project, b"nope\n", headers={"HX-Request": "true"})
    assert response.status_code == 400
    html = response.content.decode()
    assert "<html" not in html and html.lstrip().startswith('<div id="datasets-panel">')
    assert "line 1: not valid JSON" in html
    assert stored_files(settings, project) == []


def test_oversize_upload_is_413_inline(member_client, project, settings, jsonl):
    settings.DATASET_MAX_BYTES = 1024
    response = upload(member_client, project, jsonl([{"prompt": "x" * 100}] * 20))
    assert response.status_code == 413
    assert "DATASET_MAX_BYTES" in response.content.decode()
    assert not Dataset.objects.exists()
    assert stored_files(settings, project) == []


def test_duplicate_dataset_name_is_an_inline_error(member_client, project, make_dataset, jsonl):
    make_dataset(project, name="dup")
    response = upload(member_client, project, jsonl([{"prompt": "x"}]), name="dup")
    assert response.status_code == 400
    assert "already exists" in response.content.decode()
    assert Dataset.objects.count() == 1


def test_upload_without_a_file_is_400(member_client, project):
    response = member_client.post(reverse("dashboard:datasets", args=[project.id]), {"name": "x"})
    assert response.status_code == 400
    assert not Dataset.objects.exists()


def test_deleting_a_dataset_in_use_is_refused_with_a_message(
    member_client, project, make_dataset, make_run
):
    dataset = make_dataset(project)
    make_run(project, name="needs-it", dataset=dataset)
    url = reverse("dashboard:dataset", args=[project.id, dataset.id])
    response = member_client.post(url, follow=True)
    assert "needs-it" in response.content.decode()
    assert Dataset.objects.filter(pk=dataset.pk).exists() and dataset.path.exists()


def test_deleting_an_unused_dataset_removes_it(
    member_client, project, make_dataset, django_capture_on_commit_callbacks
):
    dataset = make_dataset(project)
    url = reverse("dashboard:dataset", args=[project.id, dataset.id])
    with django_capture_on_commit_callbacks(execute=True):
        response = member_client.post(url)
    assert response.status_code == 302
    assert not Dataset.objects.filter(pk=dataset.pk).exists()
    assert not dataset.path.exists()


def test_it_validates_ownership_of_datasets(outsider_client, project, make_dataset, jsonl):
    dataset = make_dataset(project)
    url = reverse("dashboard:dataset", args=[project.id, dataset.id])
    assert outsider_client.post(url).status_code == 404
    assert upload(outsider_client, project, jsonl([{"prompt": "x"}]), name="z").status_code == 404
    assert list(Dataset.objects.all()) == [dataset]


# --- runs -----------------------------------------------------------------------------------


def browser_defaults(**changes) -> dict:
    """What a browser submits for the untouched new-run form, with ``changes`` applied."""
    data = {}
    for name, field in RunForm().fields.items():
        initial = field.initial
        if isinstance(initial, bool):
            if initial:
                data[name] = "on"
        else:
            data[name] = "" if initial is None else str(initial)
    data |= {"name": "web-run", "mode": "online", "base_model": "tiny-llama"}
    for name, value in changes.items():
        if value is None:
            data.pop(name, None)
        else:
            data[name] = value
    return data


def test_run_form_with_defaults_creates_a_run_with_the_same_config_as_the_api(
    member_client, project, model_named
):
    from rl_core.config import RunConfig

    url = reverse("dashboard:run-new", args=[project.id])
    data = browser_defaults(reward="")
    response = member_client.post(url, data)
    run = Run.objects.get(project=project)
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:run", args=[project.id, run.id])
    assert run.config == RunConfig(mode="online", base_model=model_named("tiny-llama")).to_dict()


def test_run_form_offers_the_pools_and_attaches_a_lora_run_to_the_one_picked(
    member_client, project
):
    from webapp.pools.services import pool_create

    pool_create(name="demo", base_model="tiny-llama", backend="torch", start=False)
    url = reverse("dashboard:run-new", args=[project.id])
    page = member_client.get(url).content.decode()
    assert '<option value="demo">demo (tiny-llama, stopped)</option>' in page
    data = browser_defaults(reward="", lora_rank="8", inference_pool="demo")
    assert member_client.post(url, data).status_code == 302
    run = Run.objects.get(project=project)
    assert (run.config["inference_pool"], run.config["lora_rank"]) == ("demo", 8)


def test_run_form_refuses_a_full_weight_run_on_a_pool_next_to_the_field(member_client, project):
    from webapp.pools.services import pool_create

    pool_create(name="demo", base_model="tiny-llama", backend="torch", start=False)
    url = reverse("dashboard:run-new", args=[project.id])
    response = member_client.post(url, browser_defaults(reward="", inference_pool="demo"))
    assert response.status_code == 400 and not Run.objects.exists()
    assert "full-weight" in response.context["form"].errors["inference_pool"][0]


def test_run_form_dataset_mode_links_the_dataset(member_client, project, make_dataset):
    dataset = make_dataset(project)
    data = browser_defaults(mode="dataset", dataset=str(dataset.id), max_staleness="0")
    response = member_client.post(reverse("dashboard:run-new", args=[project.id]), data)
    assert response.status_code == 302
    run = Run.objects.get(project=project)
    assert run.dataset == dataset and run.config["max_staleness"] == 0
    assert run.config["reward"] == {"type": "exact_match"}


@pytest.mark.parametrize(
    "changes,field,phrase",
    [
        ({"max_staleness": "-1"}, "max_staleness", "at least 0"),
        ({"max_staleness": "four"}, "max_staleness", "whole number"),
        ({"base_model": ""}, "base_model", "required"),
        ({"inference_backend": "tgi"}, "inference_backend", "valid choice"),
        ({"reward": "{not json"}, "reward", "JSON object"),
        ({"reward": '{"type": "regex", "pattern": "("}'}, "reward", "regular expression"),
        ({"reward": '{"type": "python"}'}, "reward", "module.submodule:function"),
        ({"mode": "dataset", "reward": ""}, "reward", "needs a reward"),
        ({"mode": "dataset"}, "dataset", "needs a dataset"),
        ({"top_p": "2"}, "top_p", "at most 1"),
        ({"ppo_minibatches": "9"}, "ppo_minibatches", "batch_size"),
    ],
)
def test_run_form_errors_are_shown_per_field(member_client, project, changes, field, phrase):
    response = member_client.post(
        reverse("dashboard:run-new", args=[project.id]), browser_defaults(**changes)
    )
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert field in errors, errors
    assert phrase in " ".join(errors[field])
    html = response.content.decode()
    block = html.split(f'<label for="id_{field}">')[0].rsplit('<div class="field', 1)[1]
    assert "has-error" in block
    assert not Run.objects.exists()


def test_run_form_folds_the_advanced_settings_and_opens_them_on_an_error(member_client, project):
    url = reverse("dashboard:run-new", args=[project.id])
    html = member_client.get(url).content.decode()
    basic, advanced = html.split('<details class="advanced-settings"')
    for name in ("train_workers", "precision", "lora_rank", "learning_rate"):
        assert f'id="id_{name}"' in advanced and f'id="id_{name}"' not in basic
    assert 'id="id_max_steps"' in basic
    assert advanced.startswith(' id="advanced">')  # folded

    response = member_client.post(url, browser_defaults(lora_rank="-2"))
    assert response.status_code == 400
    advanced = response.content.decode().split('<details class="advanced-settings"')[1]
    assert advanced.startswith(' id="advanced" open>')
    assert "at least 0" in advanced

    response = member_client.post(
        url, browser_defaults(lora_rank="8", lora_target_modules="q_proj, v_proj")
    )
    assert response.status_code == 302
    config = Run.objects.get(project=project).config
    assert (config["lora_rank"], config["lora_target_modules"]) == (8, ["q_proj", "v_proj"])


def test_run_form_refuses_another_projects_dataset(
    member_client, project, other_project, make_dataset
):
    theirs = make_dataset(other_project)
    data = browser_defaults(mode="dataset", dataset=str(theirs.id))
    response = member_client.post(reverse("dashboard:run-new", args=[project.id]), data)
    assert response.status_code == 400
    assert "dataset" in response.context["form"].errors
    assert not Run.objects.exists()


def test_start_and_stop_buttons_move_the_run(member_client, project, make_run):
    run = make_run(project)
    start = reverse("dashboard:run-action", args=[project.id, run.id, "start"])
    stop = reverse("dashboard:run-action", args=[project.id, run.id, "stop"])
    assert member_client.post(start).status_code == 302
    assert Run.objects.get(pk=run.pk).status == "queued"
    response = member_client.post(start, follow=True)
    assert "cannot become queued" in response.content.decode()
    assert member_client.post(stop).status_code == 302
    assert Run.objects.get(pk=run.pk).status == "stopping"
    bogus = reverse("dashboard:run-action", args=[project.id, run.id, "explode"])
    assert member_client.post(bogus).status_code == 404


def test_it_validates_ownership_of_runs(outsider_client, project, make_run):
    run = make_run(project)
    start = reverse("dashboard:run-action", args=[project.id, run.id, "start"])
    assert outsider_client.post(start).status_code == 404
    new = reverse("dashboard:run-new", args=[project.id])
    assert outsider_client.post(new, browser_defaults()).status_code == 404
    assert Run.objects.get(pk=run.pk).status == "draft"
    assert Run.objects.count() == 1


# --- agents ---------------------------------------------------------------------------------


def test_agent_form_creates_an_agent_on_a_run(member_client, project, make_run):
    from webapp.agents.models import Agent

    run = make_run(project)
    response = member_client.post(
        reverse("dashboard:agents", args=[project.id]), {"name": "bot", "run": str(run.id)}
    )
    agent = Agent.objects.get(project=project)
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:agent", args=[project.id, agent.id])
    assert agent.run == run


def test_it_validates_ownership_of_agents(
    member_client, outsider_client, project, other_project, make_run
):
    from webapp.agents.models import Agent

    theirs = make_run(other_project)
    url = reverse("dashboard:agents", args=[project.id])
    assert outsider_client.post(url, {"name": "intruder"}).status_code == 404
    response = member_client.post(url, {"name": "x", "run": str(theirs.id)})
    assert response.status_code == 200 and "run" in response.context["form"].errors
    assert not Agent.objects.exists()
