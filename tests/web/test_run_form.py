"""The new-run form: the essentials open, the rest under Advanced by group, presets that fill it."""

from __future__ import annotations

import json
import re

import pytest
from django.urls import reverse

from rl_core.config import RunConfig
from rl_core.config_groups import ESSENTIALS, SETTING_GROUPS
from rl_core.toy import DEMO_SETTINGS
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db

ESSENTIAL = ("name", "mode", "base_model", "dataset", "reward", "max_steps")
SETTINGS = [spec.name for spec in RunConfig.field_specs()]


def url(project, preset: str | None = None) -> str:
    base = reverse("dashboard:run-new", args=[project.id])
    return f"{base}?preset={preset}" if preset else base


def split(html: str) -> tuple[str, str]:
    """The page before the Advanced disclosure, and the disclosure with what follows it."""
    before, advanced = html.split('<details class="advanced-settings"')
    return before, advanced


def presets_json(html: str) -> dict[str, dict]:
    found = re.search(r'<script id="run-presets" type="application/json">(.*?)</script>', html)
    return json.loads(found.group(1))


def as_submitted(values: dict, **changes) -> dict:
    """What a browser submits for a form holding ``values`` (checkboxes: "on" or absent)."""
    data = {k: ("on" if v is True else v) for k, v in (values | changes).items() if v is not False}
    return {k: v for k, v in data.items() if v is not None}


def test_the_essentials_are_open_and_every_other_setting_is_under_advanced_once(
    member_client, project
):
    html = member_client.get(url(project)).content.decode()
    before, advanced = split(html)
    assert advanced.startswith(' id="advanced">')  # folded
    for name in ESSENTIAL:
        assert f'name="{name}"' in before, name
    for name in SETTINGS:
        assert html.count(f'name="{name}"') == 1, name
        if name not in ESSENTIAL:
            assert f'name="{name}"' in advanced, name
    legends = re.findall(r"<legend>([^<]+)</legend>", advanced)
    assert legends == [group for group in SETTING_GROUPS if group != ESSENTIALS]
    assert "Create run</button>" in html


def test_with_a_shared_pool_the_pool_and_lora_rank_are_essentials(member_client, project):
    from webapp.pools.services import pool_create

    pool_create(name="shared", base_model="tiny-llama", backend="torch", start=False)
    before, advanced = split(member_client.get(url(project)).content.decode())
    for name in ("inference_pool", "lora_rank"):
        assert f'name="{name}"' in before and f'name="{name}"' not in advanced


def test_the_demo_preset_prefills_the_form_with_the_demos_settings(
    member_client, project, make_dataset, settings
):
    dataset = make_dataset(project, name="say-the-letter")
    response = member_client.get(url(project, "demo"))
    form = response.context["form"]
    assert form["mode"].value() == "dataset"
    assert form["base_model"].value() == settings.STEEP_DEMO_MODEL
    assert form["dataset"].value() == str(dataset.id)
    assert json.loads(form["reward"].value()) == DEMO_SETTINGS["reward"]
    for name in ("batch_size", "group_size", "learning_rate", "max_steps", "save_every"):
        assert form[name].value() == DEMO_SETTINGS[name], name
    html = response.content.decode()
    assert re.search(r'<input type="number" name="batch_size" value="64"', html)
    assert '<a class="button" href="?preset=demo" data-preset="demo"' in html
    assert 'aria-current="true">Like the demo</a>' in html


def test_what_the_script_fills_in_is_what_the_server_renders_for_each_preset(
    member_client, project
):
    from webapp.pools.services import pool_create

    pool_create(name="demo", base_model="tiny-llama", backend="torch", start=False)
    presets = presets_json(member_client.get(url(project)).content.decode())
    assert list(presets) == ["defaults", "demo", "lora-pool"]
    for slug, values in presets.items():
        form = member_client.get(url(project, slug)).context["form"]
        assert set(values) == set(form.fields) - {"name"}
        for name, value in values.items():
            shown = form[name].value()
            if not isinstance(value, bool):
                shown = "" if shown is None else str(shown)
            assert shown == value, (slug, name)


def test_a_run_created_from_the_demo_preset_has_the_demos_config(
    member_client, project, make_dataset, settings
):
    dataset = make_dataset(project, name="say-the-letter")
    values = presets_json(member_client.get(url(project)).content.decode())["demo"]
    response = member_client.post(url(project, "demo"), as_submitted(values, name="letters"))
    assert response.status_code == 302, response.context["form"].errors
    run = Run.objects.get(project=project)
    assert response["Location"] == reverse("dashboard:run", args=[project.id, run.id])
    expected = {"mode": "dataset", "base_model": settings.STEEP_DEMO_MODEL, **DEMO_SETTINGS}
    assert run.config == RunConfig.from_dict(expected).to_dict()
    assert run.dataset == dataset and run.name == "letters"


def test_a_lora_run_from_the_pool_preset_attaches_to_the_pool(member_client, project):
    from webapp.pools.services import pool_create

    pool_create(name="demo", base_model="tiny-llama", backend="torch", start=False)
    form = member_client.get(url(project, "lora-pool")).context["form"]
    assert (form["inference_pool"].value(), form["lora_rank"].value()) == ("demo", 8)
    values = presets_json(member_client.get(url(project)).content.decode())["lora-pool"]
    response = member_client.post(url(project), as_submitted(values, name="adapter"))
    assert response.status_code == 302, response.context["form"].errors
    config = Run.objects.get(project=project).config
    assert (config["mode"], config["inference_pool"], config["lora_rank"]) == ("online", "demo", 8)
    assert config["reward"] == {}


def test_without_a_pool_there_is_no_pool_preset(member_client, project):
    assert "lora-pool" not in presets_json(member_client.get(url(project)).content.decode())
    assert member_client.get(url(project, "lora-pool")).context["preset"] is None


def test_the_fields_a_first_run_needs_are_enough_to_create_it(member_client, project):
    defaults = presets_json(member_client.get(url(project)).content.decode())["defaults"]
    data = as_submitted(
        defaults, name="first", mode="online", base_model="tiny-llama", reward="", max_steps="20"
    )
    response = member_client.post(url(project), data)
    assert response.status_code == 302, response.context["form"].errors
    run = Run.objects.get(project=project)
    assert (run.name, run.mode, run.config["max_steps"]) == ("first", "online", 20)


def test_an_invalid_advanced_setting_reopens_advanced_with_the_error_beside_it(
    member_client, project
):
    defaults = presets_json(member_client.get(url(project)).content.decode())["defaults"]
    data = as_submitted(
        defaults, name="x", mode="online", base_model="tiny-llama", reward="", learning_rate="-1"
    )
    response = member_client.post(url(project), data)
    assert response.status_code == 400 and not Run.objects.exists()
    before, advanced = split(response.content.decode())
    assert advanced.startswith(' id="advanced" open>')
    optimisation = advanced.split("<legend>Optimisation</legend>")[1].split("</fieldset>")[0]
    field = optimisation.split('<label for="id_learning_rate">')[0].rsplit('<div class="field', 1)
    assert "has-error" in field[1]
    assert "learning_rate must be greater than 0" in optimisation
    assert 'name="learning_rate" value="-1"' in optimisation  # what was typed is kept


def test_an_error_in_an_essential_leaves_advanced_folded(member_client, project):
    defaults = presets_json(member_client.get(url(project)).content.decode())["defaults"]
    response = member_client.post(url(project), as_submitted(defaults, name="x", base_model=""))
    assert response.status_code == 400
    before, advanced = split(response.content.decode())
    assert advanced.startswith(' id="advanced">')
    assert "has-error" in before.split('<label for="id_base_model">')[0].rsplit("<div", 1)[1]


def test_an_unknown_preset_is_named_and_the_form_keeps_its_defaults(member_client, project):
    response = member_client.get(url(project, "nope"))
    assert response.status_code == 200
    assert "There is no preset “nope”" in response.content.decode()
    assert response.context["form"]["mode"].value() == "dataset"


@pytest.mark.parametrize("hub", [False, True])
def test_base_model_help_says_what_this_instance_accepts(member_client, project, settings, hub):
    settings.STEEP_HUB_MODELS = hub
    form = member_client.get(url(project)).context["form"]
    text = form.fields["base_model"].help_text
    assert settings.STEEP_MODEL_ROOTS[0] in text
    assert ("or a Hugging Face id (org/name)" in text) is hub
    assert ("not a Hugging Face id" in text) is not hub
    defaults = presets_json(member_client.get(url(project)).content.decode())["defaults"]
    data = as_submitted(defaults, name="hub", mode="online", reward="", base_model="org/model")
    response = member_client.post(url(project), data)
    assert response.status_code == (302 if hub else 400)
    assert Run.objects.filter(project=project).exists() is hub
