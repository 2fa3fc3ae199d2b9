"""Runs over the API: start/stop through the state machine, delete, metrics and checkpoints."""

from __future__ import annotations

import pytest

from webapp.runs.models import Checkpoint, MetricPoint, Run

pytestmark = pytest.mark.django_db

S = Run.Status


@pytest.fixture
def run(project, make_run):
    return make_run(project, name="r1")


def test_start_from_draft_is_202_queued(api, run):
    response = api.post(f"/api/v1/runs/{run.id}/start/")
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "queued" and body["queued_at"]
    assert body["events"][0]["kind"] == "status:queued"
    assert Run.objects.get(pk=run.pk).status == S.QUEUED


def test_start_twice_is_409(api, run, api_error):
    assert api.post(f"/api/v1/runs/{run.id}/start/").status_code == 202
    error = api_error(api.post(f"/api/v1/runs/{run.id}/start/"), 409)
    assert error["code"] == "conflict"
    assert "queued" in error["message"]
    assert Run.objects.get(pk=run.pk).status == S.QUEUED


def test_stop_of_a_draft_is_409(api, run, api_error):
    api_error(api.post(f"/api/v1/runs/{run.id}/stop/"), 409)
    assert Run.objects.get(pk=run.pk).status == S.DRAFT


def test_stop_of_a_queued_run_is_202_stopping(api, run):
    api.post(f"/api/v1/runs/{run.id}/start/")
    response = api.post(f"/api/v1/runs/{run.id}/stop/")
    assert response.status_code == 202
    assert response.json()["status"] == "stopping"
    assert Run.objects.get(pk=run.pk).status == S.STOPPING


@pytest.mark.parametrize("status", [S.STOPPED, S.FAILED])
def test_a_stopped_or_failed_run_can_be_started_again(api, run, set_status, status):
    set_status(run, status)
    response = api.post(f"/api/v1/runs/{run.id}/start/")
    assert response.status_code == 202 and response.json()["status"] == "queued"


def test_completed_run_cannot_start_again(api, run, set_status, api_error):
    set_status(run, S.COMPLETED)
    assert "final state" in api_error(api.post(f"/api/v1/runs/{run.id}/start/"), 409)["message"]


@pytest.mark.parametrize("status", [S.QUEUED, S.STARTING, S.RUNNING, S.STOPPING])
def test_delete_of_an_active_run_is_409(api, run, set_status, api_error, status):
    set_status(run, status)
    assert "Stop it first" in api_error(api.delete(f"/api/v1/runs/{run.id}/"), 409)["message"]
    assert Run.objects.filter(pk=run.pk).exists()


def test_delete_of_a_draft_is_204(api, run):
    assert api.delete(f"/api/v1/runs/{run.id}/").status_code == 204
    assert not Run.objects.filter(pk=run.pk).exists()
    assert api.get(f"/api/v1/runs/{run.id}/").status_code == 404


def test_detail_shows_status_config_and_newest_events_first(api, run, model_named):
    api.post(f"/api/v1/runs/{run.id}/start/")
    body = api.get(f"/api/v1/runs/{run.id}/").json()
    assert body["id"] == str(run.id) and body["name"] == "r1"
    assert body["config"]["base_model"] == model_named("tiny-llama")  # as the server loads it
    assert [e["kind"] for e in body["events"]] == ["status:queued", "created"]


def test_list_filters_by_status(api, project, make_run, set_status, api_error):
    set_status(make_run(project, name="a"), S.RUNNING)
    make_run(project, name="b")
    assert [r["name"] for r in api.get("/api/v1/runs/?status=running").json()["results"]] == ["a"]
    assert api.get("/api/v1/runs/").json()["count"] == 2
    assert "status" in api_error(api.get("/api/v1/runs/?status=bogus"), 400)["fields"]


@pytest.fixture
def metrics(run):
    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, step=step, name=name, value=step * (1 if name == "loss" else 10))
        for step in range(1, 11)
        for name in ("loss", "rollout/reward")
    )


def test_metrics_are_oldest_first(api, run, metrics):
    body = api.get(f"/api/v1/runs/{run.id}/metrics/").json()
    assert body["count"] == 20
    keys = [(p["step"], p["name"]) for p in body["results"]]
    assert keys == sorted(keys)
    assert body["results"][1] == {
        "step": 1,
        "name": "rollout/reward",
        "value": 10.0,
        "created_at": body["results"][1]["created_at"],
    }


def test_metrics_filter_by_name(api, run, metrics):
    body = api.get(f"/api/v1/runs/{run.id}/metrics/?name=rollout/reward").json()
    assert body["count"] == 10
    assert {p["name"] for p in body["results"]} == {"rollout/reward"}


def test_metrics_filter_by_since_step(api, run, metrics):
    body = api.get(f"/api/v1/runs/{run.id}/metrics/?since_step=7").json()
    assert body["count"] == 6
    assert {p["step"] for p in body["results"]} == {8, 9, 10}
    both = api.get(f"/api/v1/runs/{run.id}/metrics/?since_step=7&name=loss").json()
    assert [(p["step"], p["value"]) for p in both["results"]] == [(8, 8.0), (9, 9.0), (10, 10.0)]


def test_metrics_are_paginated(api, run, metrics):
    first = api.get(f"/api/v1/runs/{run.id}/metrics/?name=loss&page_size=4").json()
    assert first["count"] == 10 and len(first["results"]) == 4
    assert first["previous"] is None and "page=2" in first["next"]
    assert [p["step"] for p in first["results"]] == [1, 2, 3, 4]
    last = api.get(first["next"].replace("http://testserver", "")).json()
    assert [p["step"] for p in last["results"]] == [5, 6, 7, 8]
    third = api.get(f"/api/v1/runs/{run.id}/metrics/?name=loss&page_size=4&page=3").json()
    assert [p["step"] for p in third["results"]] == [9, 10] and third["next"] is None


def test_metrics_with_a_bad_since_step_is_400(api, run, api_error):
    error = api_error(api.get(f"/api/v1/runs/{run.id}/metrics/?since_step=soon"), 400)
    assert "since_step" in error["fields"]


def test_metrics_of_another_run_are_not_mixed_in(api, project, make_run, run, metrics):
    other = make_run(project, name="r2")
    MetricPoint.objects.create(run=other, step=1, name="loss", value=99.0)
    values = [p["value"] for p in api.get(f"/api/v1/runs/{other.id}/metrics/").json()["results"]]
    assert values == [99.0]


def test_checkpoints_are_newest_first(api, run):
    for version in (1, 3, 2):
        Checkpoint.objects.create(
            run=run, version=version, step=version * 50, path=f"/c/v{version}", size_bytes=7
        )
    body = api.get(f"/api/v1/runs/{run.id}/checkpoints/").json()
    assert body["count"] == 3
    assert [(c["version"], c["step"], c["path"]) for c in body["results"]] == [
        (3, 150, "/c/v3"),
        (2, 100, "/c/v2"),
        (1, 50, "/c/v1"),
    ]


def test_run_without_checkpoints_lists_none(api, run):
    assert api.get(f"/api/v1/runs/{run.id}/checkpoints/").json() == {
        "count": 0,
        "next": None,
        "previous": None,
        "results": [],
    }
