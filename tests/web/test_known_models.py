"""base_model needs no typing: the form and ``GET /api/v1/models/`` offer the models this
instance offers (the demo model, the project's that the rules still allow, the model
directories under STEEP_MODEL_ROOTS)."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from webapp.runs.models import Run

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo_model(settings, tmp_path):
    path = tmp_path / "tiny-chat"
    path.mkdir()
    settings.STEEP_DEMO_MODEL = str(path)
    return str(path)


@pytest.fixture
def models_dir(settings, tmp_path):
    settings.DATA_DIR = tmp_path / "data"
    for name in ("qwen", "smol"):
        (settings.DATA_DIR / "models" / name).mkdir(parents=True)
        (settings.DATA_DIR / "models" / name / "config.json").write_text("{}")
    (settings.DATA_DIR / "models" / "half-downloaded").mkdir()  # no config.json: not a model
    settings.STEEP_MODEL_ROOTS = [str(settings.DATA_DIR / "models")]
    return settings.DATA_DIR / "models"


def test_the_demo_model_comes_first_then_the_projects_then_the_models_folder(
    api, project, make_run, demo_model, models_dir, settings
):
    settings.STEEP_HUB_MODELS = True
    make_run(project, name="old", base_model=str(models_dir / "smol"))
    make_run(project, name="new", base_model="Qwen/Qwen2.5-0.5B-Instruct")
    body = api.get("/api/v1/models/").json()
    assert body == [
        {"name": demo_model, "source": "demo"},
        {"name": "Qwen/Qwen2.5-0.5B-Instruct", "source": "project"},
        {"name": str(models_dir / "smol"), "source": "project"},
        {"name": str(models_dir / "qwen"), "source": "models_dir"},
    ]


def test_a_demo_model_that_was_never_built_is_not_offered(api, settings, tmp_path):
    settings.STEEP_DEMO_MODEL = str(tmp_path / "missing")
    settings.DATA_DIR = tmp_path
    settings.STEEP_MODEL_ROOTS = [str(tmp_path / "models")]
    assert api.get("/api/v1/models/").json() == []


def test_another_projects_models_are_not_offered(
    api, other_project, make_run, demo_model, settings, tmp_path
):
    settings.DATA_DIR = tmp_path
    settings.STEEP_MODEL_ROOTS = [str(tmp_path / "models")]
    (tmp_path / "models" / "theirs").mkdir(parents=True)  # a directory, not listed as a model
    make_run(other_project, base_model=str(tmp_path / "models" / "theirs"))
    assert [m["name"] for m in api.get("/api/v1/models/").json()] == [demo_model]


def test_a_model_the_project_named_before_the_rules_is_no_longer_offered(
    api, project, demo_model, settings, tmp_path
):
    settings.STEEP_MODEL_ROOTS = [str(tmp_path / "models")]
    Run.objects.create(project=project, name="old", mode="online", base_model="/etc")
    assert [m["name"] for m in api.get("/api/v1/models/").json()] == [demo_model]


def test_models_need_a_key(anon_api, api_error):
    api_error(anon_api.get("/api/v1/models/"), 401)


def _base_model_input(html: str) -> str:
    return re.search(r'<input[^>]*name="base_model"[^>]*>', html).group(0)


def test_the_run_form_fills_in_the_demo_model_and_lists_the_others(
    member_client, project, demo_model, models_dir
):
    html = member_client.get(reverse("dashboard:run-new", args=[project.id])).content.decode()
    field = _base_model_input(html)
    assert f'value="{demo_model}"' in field and 'list="known-models"' in field
    datalist = html.split('<datalist id="known-models">')[1].split("</datalist>")[0]
    assert re.findall(r'<option value="([^"]+)">', datalist) == [
        demo_model,
        str(models_dir / "qwen"),
        str(models_dir / "smol"),
    ]


def test_the_run_form_fills_in_the_model_the_project_used_last(
    member_client, project, make_run, demo_model, models_dir
):
    make_run(project, base_model=str(models_dir / "smol"))
    html = member_client.get(reverse("dashboard:run-new", args=[project.id])).content.decode()
    assert f'value="{models_dir / "smol"}"' in _base_model_input(html)


def test_an_online_run_is_created_without_typing_a_model(member_client, project, demo_model):
    from tests.web.test_dashboard_forms import browser_defaults

    data = browser_defaults(base_model=None, reward="", name="no typing")
    form = member_client.get(reverse("dashboard:run-new", args=[project.id])).context["form"]
    data["base_model"] = form["base_model"].value()  # what the browser submits untouched
    response = member_client.post(reverse("dashboard:run-new", args=[project.id]), data)
    assert response.status_code == 302, response.context["form"].errors
    assert Run.objects.get(project=project).base_model == demo_model


def test_model_names_are_escaped_in_the_form(member_client, project, make_run, settings, tmp_path):
    settings.STEEP_DEMO_MODEL = str(tmp_path / "missing")
    settings.STEEP_MODEL_ROOTS = [str(tmp_path)]
    (tmp_path / '"><img src=x onerror=alert(1)>').mkdir()
    make_run(project, base_model='"><img src=x onerror=alert(1)>')
    html = member_client.get(reverse("dashboard:run-new", args=[project.id])).content.decode()
    assert "<img src=x" not in html and "&lt;img src=x" in html
