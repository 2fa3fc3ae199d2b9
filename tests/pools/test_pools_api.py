"""/api/v1/pools/: staff manage pools; project keys and members are refused without leaks."""

from __future__ import annotations

import pytest

from webapp.pools.models import Pool

BODY = {"name": "shared-tiny", "base_model": "tiny-llama", "backend": "torch", "start": False}


def test_staff_create_list_show_and_scale_a_pool(staff_api, model_named):
    created = staff_api.post("/api/v1/pools/", {**BODY, "replicas": 2}, format="json")
    assert created.status_code == 201, created.content
    pool = created.json()
    assert (pool["name"], pool["base_model"], pool["backend"]) == (
        "shared-tiny",
        model_named("tiny-llama"),  # as runs name it: the directory the servers load
        "torch",
    )
    assert (pool["replicas"], pool["status"], pool["max_lora_rank"]) == (2, "stopped", 64)
    assert pool["stats"] == {
        "servers": [],
        "servers_reporting": 0,
        "runs": [],
        "loaded_adapters": [],
        "evicted_adapters": [],
    }

    listed = staff_api.get("/api/v1/pools/").json()
    assert [p["name"] for p in listed["results"]] == ["shared-tiny"]

    scaled = staff_api.post("/api/v1/pools/shared-tiny/scale/", {"replicas": 3}, format="json")
    assert scaled.status_code == 202
    assert Pool.objects.get(name="shared-tiny").replicas == 3
    assert staff_api.get("/api/v1/pools/shared-tiny/").json()["replicas"] == 3


def test_an_empty_pool_list_is_an_empty_page(staff_api):
    body = staff_api.get("/api/v1/pools/").json()
    assert body["results"] == [] and body["count"] == 0


def test_creating_a_pool_queues_its_job(staff_api, monkeypatch, django_capture_on_commit_callbacks):
    from webapp.pools import tasks

    queued = []
    monkeypatch.setattr(tasks.pool_launch, "delay", queued.append)
    with django_capture_on_commit_callbacks(execute=True):
        response = staff_api.post("/api/v1/pools/", {**BODY, "start": True}, format="json")
    assert response.json()["status"] == "starting"
    assert queued == [response.json()["id"]]


@pytest.mark.parametrize(
    "body, field",
    [
        ({**BODY, "name": "Not A Slug!"}, "name"),
        ({**BODY, "replicas": -1}, "replicas"),
        ({**BODY, "replicas": 10_000}, "replicas"),
        ({**BODY, "replicas": "two"}, "replicas"),
        ({**BODY, "backend": "tgi"}, "backend"),
        ({**BODY, "tensor_parallel": 0}, "tensor_parallel"),
        ({**BODY, "max_lora_rank": 0}, "max_lora_rank"),
        ({**BODY, "base_model": ""}, "base_model"),
        ({**BODY, "replica": 2}, "replica"),
        ({k: v for k, v in BODY.items() if k != "name"}, "name"),
    ],
)
def test_a_bad_pool_is_a_400_naming_the_field(staff_api, api_error, body, field):
    error = api_error(staff_api.post("/api/v1/pools/", body, format="json"), 400)
    assert field in error["fields"], error
    assert not Pool.objects.exists()


def test_a_second_pool_of_the_same_name_is_a_400(staff_api, make_pool, api_error):
    make_pool(name="shared-tiny")
    error = api_error(staff_api.post("/api/v1/pools/", BODY, format="json"), 400)
    assert "name" in error["fields"]


def test_malformed_json_and_a_non_object_are_400(staff_api, make_pool, api_error):
    make_pool(name="shared-tiny")
    bad = staff_api.post("/api/v1/pools/", "{nope", content_type="application/json")
    api_error(bad, 400)
    api_error(staff_api.post("/api/v1/pools/", [1, 2], format="json"), 400)
    scale = staff_api.post("/api/v1/pools/shared-tiny/scale/", {"replicas": "x"}, format="json")
    assert "replicas" in api_error(scale, 400)["fields"]
    api_error(staff_api.post("/api/v1/pools/shared-tiny/scale/", {}, format="json"), 400)


def test_an_unknown_pool_is_a_404(staff_api, api_error):
    api_error(staff_api.get("/api/v1/pools/nope/"), 404)
    api_error(staff_api.post("/api/v1/pools/nope/scale/", {"replicas": 1}, format="json"), 404)


def test_a_project_key_cannot_list_create_see_or_scale_pools(api, make_pool, api_error):
    make_pool(name="shared-tiny")
    assert "operators" in api_error(api.get("/api/v1/pools/"), 403)["message"]
    api_error(api.post("/api/v1/pools/", BODY, format="json"), 403)
    api_error(api.get("/api/v1/pools/shared-tiny/"), 404)
    api_error(api.post("/api/v1/pools/shared-tiny/scale/", {"replicas": 5}, format="json"), 404)
    api_error(api.post("/api/v1/pools/shared-tiny/start/"), 404)
    api_error(api.post("/api/v1/pools/shared-tiny/stop/"), 404)
    assert Pool.objects.get().replicas == 1


def test_a_member_who_is_not_staff_is_refused_too(member_client, make_pool):
    make_pool(name="shared-tiny")
    assert member_client.get("/api/v1/pools/").status_code == 403
    assert member_client.get("/api/v1/pools/shared-tiny/").status_code == 404


def test_no_credentials_is_a_401(anon_api, api_error):
    api_error(anon_api.get("/api/v1/pools/"), 401)


def test_start_and_stop_follow_the_pool_lifecycle(staff_api, make_pool, api_error):
    make_pool(name="shared-tiny")
    started = staff_api.post("/api/v1/pools/shared-tiny/start/")
    assert started.status_code == 202 and started.json()["status"] == "starting"
    again = api_error(staff_api.post("/api/v1/pools/shared-tiny/start/"), 409)
    assert "starting" in again["message"]
    # No job was submitted yet: a stop settles at once.
    assert staff_api.post("/api/v1/pools/shared-tiny/stop/").json()["status"] == "stopped"
