"""A new run is checked against the Ray cluster a run's job last reported (GPUs, CPUs)."""

from __future__ import annotations

import pytest

from webapp.runs.jobs import job_report_cluster
from webapp.runs.models import ClusterReport, Run

pytestmark = pytest.mark.django_db

ONLINE = {"name": "r1", "mode": "online", "base_model": "tiny-llama"}


@pytest.fixture
def reported(project, make_run):
    run = make_run(project)  # the run whose job reports, made before any report

    def report(gpus: float, cpus: float) -> None:
        job_report_cluster(run=run, gpus=gpus, cpus=cpus)

    return report


def _fields(response) -> dict:
    assert response.status_code == 400, response.json()
    return response.json()["error"]["fields"]


def test_more_train_workers_than_the_clusters_gpus_is_refused_with_the_numbers(api, reported):
    reported(gpus=2, cpus=32)
    fields = _fields(api.post("/api/v1/runs/", ONLINE | {"train_workers": 4}, format="json"))
    assert list(fields) == ["train_workers"]
    assert fields["train_workers"][0].startswith(
        "train_workers=4 and 1 SGLang server need 5 GPUs; the cluster has 2."
    ), fields
    created = api.post("/api/v1/runs/", ONLINE | {"train_workers": 1}, format="json")
    assert created.status_code == 201, created.json()


def test_bf16_on_a_cpu_only_cluster_is_refused_naming_precision(api, reported):
    reported(gpus=0, cpus=8)
    fields = _fields(api.post("/api/v1/runs/", ONLINE | {"precision": "bf16"}, format="json"))
    assert list(fields) == ["precision"]
    assert "needs GPUs" in fields["precision"][0]
    assert (
        api.post("/api/v1/runs/", ONLINE | {"precision": "fp32"}, format="json").status_code == 201
    )


def test_a_cpu_cluster_counts_cpus_for_trainer_workers_and_torch_engines(api, reported):
    reported(gpus=0, cpus=4)
    fields = _fields(
        api.post(
            "/api/v1/runs/",
            ONLINE | {"train_workers": 3, "num_inference_servers": 2},
            format="json",
        )
    )
    assert "need 5 CPUs; the cluster has 4" in fields["train_workers"][0]


def test_without_a_report_nothing_is_assumed_about_the_cluster(api):
    assert not ClusterReport.objects.exists()
    response = api.post(
        "/api/v1/runs/", ONLINE | {"train_workers": 64, "precision": "bf16"}, format="json"
    )
    assert response.status_code == 201, response.json()
    assert Run.objects.get(pk=response.json()["id"]).config["train_workers"] == 64


def test_the_latest_report_replaces_the_previous_one(api, reported):
    reported(gpus=1, cpus=8)
    reported(gpus=8, cpus=64)
    assert ClusterReport.objects.count() == 1
    response = api.post("/api/v1/runs/", ONLINE | {"train_workers": 4}, format="json")
    assert response.status_code == 201, response.json()
