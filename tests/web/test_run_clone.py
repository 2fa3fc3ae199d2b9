"""Run again: ``POST /api/v1/runs/<id>/clone/`` and the run page's button make a draft copy."""

from __future__ import annotations

import pytest
from django.urls import reverse

from webapp.runs.models import Checkpoint, Run

pytestmark = pytest.mark.django_db

S = Run.Status


@pytest.fixture
def finished(project, make_run, make_dataset, set_status):
    run = make_run(
        project, name="letters", dataset=make_dataset(project), max_steps=40, learning_rate=3e-3
    )
    return set_status(run, S.COMPLETED)


@pytest.fixture
def checkpoint(finished, tmp_path):
    path = tmp_path / "step_000020"
    path.mkdir()
    return Checkpoint.objects.create(run=finished, version=20, step=20, path=str(path))


def clone_url(run) -> str:
    return f"/api/v1/runs/{run.id}/clone/"


@pytest.mark.parametrize("status", [S.COMPLETED, S.FAILED, S.STOPPED, S.RUNNING, S.DRAFT])
def test_any_run_can_be_cloned_into_a_draft_with_its_settings_and_dataset(
    api, finished, set_status, status
):
    set_status(finished, status)
    response = api.post(clone_url(finished), {}, format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    clone = Run.objects.get(pk=body["id"])
    assert clone.id != finished.id and clone.project == finished.project
    assert (body["status"], body["step"], body["name"]) == ("draft", 0, "letters (again)")
    assert clone.dataset == finished.dataset and clone.mode == finished.mode
    assert clone.config == finished.config
    assert [e["kind"] for e in body["events"]] == ["cloned", "created"]
    assert str(finished.id) in body["events"][0]["message"]
    assert Run.objects.get(pk=finished.pk).status == status  # the source is left alone


def test_a_clone_without_a_body_works(api, finished):
    assert api.post(clone_url(finished)).status_code == 201


def test_a_clone_takes_a_name_and_setting_overrides(api, finished):
    response = api.post(
        clone_url(finished),
        {"name": "letters, longer", "config": {"max_steps": 200, "learning_rate": 1e-3}},
        format="json",
    )
    assert response.status_code == 201
    config = response.json()["config"]
    assert response.json()["name"] == "letters, longer"
    assert (config["max_steps"], config["learning_rate"]) == (200, 1e-3)
    assert config["reward"] == finished.config["reward"]  # the rest comes from the source


def test_a_clone_from_a_checkpoint_starts_from_its_weights(api, finished, checkpoint):
    response = api.post(clone_url(finished), {"from_checkpoint": 20}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["config"]["init_checkpoint"] == str(checkpoint.pk)  # by id, never a path
    assert body["config"]["base_model"] == finished.base_model  # tokenizer, dtype: the base's
    assert body["name"] == "letters (from step 20)"
    assert "checkpoint step 20" in body["events"][0]["message"]


def test_a_clone_of_a_clone_keeps_starting_from_the_same_checkpoint(api, finished, checkpoint):
    first = api.post(clone_url(finished), {"from_checkpoint": 20}, format="json").json()
    second = api.post(f"/api/v1/runs/{first['id']}/clone/", format="json").json()
    assert second["config"]["init_checkpoint"] == str(checkpoint.pk)


def test_an_unknown_checkpoint_step_is_400_listing_the_steps_there_are(
    api, finished, checkpoint, api_error
):
    error = api_error(api.post(clone_url(finished), {"from_checkpoint": 7}, format="json"), 400)
    assert "no checkpoint at step 7" in error["fields"]["from_checkpoint"][0]
    assert "steps 20" in error["fields"]["from_checkpoint"][0]
    assert Run.objects.count() == 1


def test_a_checkpoint_whose_files_are_gone_is_400(api, finished, checkpoint, api_error):
    checkpoint.path = checkpoint.path + "-deleted"
    checkpoint.save(update_fields=["path"])
    error = api_error(api.post(clone_url(finished), {"from_checkpoint": 20}, format="json"), 400)
    assert "are gone" in error["fields"]["from_checkpoint"][0]
    assert Run.objects.count() == 1


@pytest.mark.parametrize(
    "body,field",
    [
        ({"from_checkpoint": "latest"}, "from_checkpoint"),
        ({"from_checkpoint": -1}, "from_checkpoint"),
        ({"config": {"max_steps": 0}}, "config.max_steps"),
        ({"config": {"warp_speed": True}}, "config.warp_speed"),
        ({"config": "fast"}, "config"),
        ({"name": ""}, "name"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_clone_input_is_400_naming_the_field(api, finished, api_error, body, field):
    error = api_error(api.post(clone_url(finished), body, format="json"), 400)
    assert field in error["fields"], error
    assert Run.objects.count() == 1


def test_an_unknown_run_is_404(api, api_error):
    api_error(api.post("/api/v1/runs/00000000-0000-0000-0000-000000000000/clone/"), 404)
    api_error(api.post("/api/v1/runs/not-a-uuid/clone/"), 404)


def test_it_validates_ownership(other_api, finished, api_error):
    api_error(other_api.post(clone_url(finished), {}, format="json"), 404)
    assert Run.objects.count() == 1


# --- the run page's button -----------------------------------------------------------------


def test_run_again_button_shows_on_a_finished_run_with_its_last_checkpoint(
    member_client, project, finished, checkpoint
):
    html = member_client.get(reverse("dashboard:run", args=[project.id, finished.id])).content
    again = reverse("dashboard:run-again", args=[project.id, finished.id])
    assert f'action="{again}"'.encode() in html
    assert b'name="from_checkpoint" value="20"' in html


def test_run_again_button_is_not_offered_while_the_run_is_active(
    member_client, project, finished, set_status
):
    set_status(finished, S.RUNNING)
    html = member_client.get(reverse("dashboard:run", args=[project.id, finished.id])).content
    assert reverse("dashboard:run-again", args=[project.id, finished.id]).encode() not in html


def test_run_again_makes_a_draft_and_opens_its_page(member_client, project, finished):
    response = member_client.post(reverse("dashboard:run-again", args=[project.id, finished.id]))
    clone = Run.objects.exclude(pk=finished.pk).get()
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:run", args=[project.id, clone.id])
    assert clone.status == S.DRAFT and clone.config == finished.config


def test_run_again_from_a_checkpoint(member_client, project, finished, checkpoint):
    url = reverse("dashboard:run-again", args=[project.id, finished.id])
    member_client.post(url, {"from_checkpoint": "20"})
    assert Run.objects.exclude(pk=finished.pk).get().config["init_checkpoint"] == str(checkpoint.pk)


@pytest.mark.parametrize("step", ["7", "soon"])
def test_run_again_from_a_missing_checkpoint_says_so_and_copies_nothing(
    member_client, project, finished, checkpoint, step
):
    url = reverse("dashboard:run-again", args=[project.id, finished.id])
    response = member_client.post(url, {"from_checkpoint": step}, follow=True)
    assert f"no checkpoint at step {step}" in response.content.decode()
    assert Run.objects.count() == 1


def test_run_again_validates_ownership(outsider_client, project, finished):
    url = reverse("dashboard:run-again", args=[project.id, finished.id])
    assert outsider_client.post(url).status_code == 404
    assert Run.objects.count() == 1
