"""Runs attach to a pool by name: only LoRA runs, on the pool's model and rank; their jobs
get the pool's servers, need no servers of their own, and see nothing of other runs."""

from __future__ import annotations

import pytest

from rl_core.config import ConfigError, RunConfig
from webapp.gateway.models import InferenceServer
from webapp.pools.services import (
    pool_server_register,
    pool_server_unregister,
    pool_transition,
)
from webapp.runs.jobs import job_secret_issue
from workers.capacity import check_capacity

LORA = {"mode": "online", "base_model": "tiny-llama", "lora_rank": 8}


def test_a_full_weight_run_cannot_name_a_pool():
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_dict({"mode": "online", "base_model": "tiny-llama", "inference_pool": "p"})
    (message,) = caught.value.errors["inference_pool"]
    assert "full-weight" in message and "lora_rank" in message


def test_a_full_weight_run_on_a_pool_is_a_400_naming_the_field(api, make_pool, api_error):
    make_pool(name="shared")
    body = {"name": "r", "mode": "online", "base_model": "tiny-llama", "inference_pool": "shared"}
    error = api_error(api.post("/api/v1/runs/", body, format="json"), 400)
    assert list(error["fields"]) == ["inference_pool"]
    assert "full-weight" in error["fields"]["inference_pool"][0]


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"inference_pool": "nope"}, "No inference pool is named 'nope'"),
        ({"inference_pool": "shared", "base_model": "other-model"}, "models/tiny-llama, not"),
        ({"inference_pool": "shared", "lora_rank": 128}, "up to rank 64"),
        (
            {"inference_pool": "narrow", "lora_target_modules": ["up_proj"]},
            "q_proj",
        ),
        ({"inference_pool": "narrow"}, "q_proj"),  # all-linear is more than the pool serves
    ],
)
def test_a_run_the_pool_cannot_serve_is_a_400_saying_why(api, make_pool, api_error, settings, says):
    make_pool(name="shared")
    make_pool(name="narrow", lora_target_modules=["q_proj", "v_proj"])
    body = {"name": "r", **LORA, **settings}
    error = api_error(api.post("/api/v1/runs/", body, format="json"), 400)
    assert says in error["fields"]["inference_pool"][0]


def test_a_lora_run_attaches_and_needs_no_servers_of_its_own(api, make_pool):
    make_pool(name="narrow", lora_target_modules=["q_proj", "v_proj"])
    body = {"name": "r", **LORA, "inference_pool": "narrow", "lora_target_modules": ["q_proj"]}
    created = api.post("/api/v1/runs/", body, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["config"]["inference_pool"] == "narrow"
    config = RunConfig.from_dict({**LORA, "inference_pool": "narrow", "num_inference_servers": 4})
    needs = check_capacity(config, "torch", {"CPU": 1.0})  # the trainer alone
    assert needs.total == 1.0


def test_the_run_job_gets_its_pools_servers(client, project, make_pool, make_run):
    pool = pool_transition(pool=make_pool(name="shared"), to="starting")
    pool_server_register(pool=pool, url="http://127.0.0.1:9/", backend="torch")
    run = make_run(project, **LORA, inference_pool="shared")
    secret = job_secret_issue(run=run)
    response = client.get(f"/internal/v1/runs/{run.id}/pool", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.json() == {
        "name": "shared",
        "status": "running",  # its first server made it running
        "base_model": pool.base_model,
        "servers": [{"url": "http://127.0.0.1:9", "backend": "torch"}],
    }
    alone = make_run(project, name="alone", **LORA)
    alone_secret = job_secret_issue(run=alone)
    assert (
        client.get(
            f"/internal/v1/runs/{alone.id}/pool", HTTP_AUTHORIZATION=f"Bearer {alone_secret}"
        ).status_code
        == 404
    )
    # A pool's secret is not a run's.
    assert client.get(f"/internal/v1/runs/{run.id}/pool").status_code == 401


def test_a_server_leaving_the_pool_leaves_every_attached_run(
    project, other_project, make_pool, make_run
):
    from webapp.gateway.services import inference_server_register

    pool = make_pool(name="shared")
    pool_server_register(pool=pool, url="http://127.0.0.1:9", backend="torch")
    mine = make_run(project, **LORA, inference_pool="shared")
    theirs = make_run(other_project, **LORA, inference_pool="shared")
    own = make_run(project, name="own", **LORA)
    for run in (mine, theirs, own):
        inference_server_register(run=run, url="http://127.0.0.1:9", backend="torch")
    pool_server_unregister(pool=pool, url="http://127.0.0.1:9/")
    assert list(InferenceServer.objects.values_list("run_id", flat=True)) == [own.pk]
    assert not pool.servers.exists()


def test_another_projects_key_cannot_see_a_run_on_the_pool(
    api, other_api, project, make_pool, make_run, api_error
):
    make_pool(name="shared")
    run = make_run(project, **LORA, inference_pool="shared")
    assert api.get(f"/api/v1/runs/{run.id}/").status_code == 200
    api_error(other_api.get(f"/api/v1/runs/{run.id}/"), 404)
    api_error(other_api.get("/api/v1/pools/shared/"), 404)
    assert other_api.get("/api/v1/runs/").json()["results"] == []
