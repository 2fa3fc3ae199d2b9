"""``RAY_ADDRESS`` in any of the forms Ray users write it leads Steep to the cluster's Jobs API."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import ray_cluster


@pytest.mark.parametrize(
    "address,url",
    [
        ("ray-head:6379", "http://ray-head:8265"),  # GCS address (docker compose)
        ("ray://ray-head:10001", "http://ray-head:8265"),  # Ray client address
        ("ray-head", "http://ray-head:8265"),
        (
            "http://steep-head-svc.steep.svc.cluster.local:8265",
            "http://steep-head-svc.steep.svc.cluster.local:8265",
        ),
        ("https://ray.example.com/", "https://ray.example.com"),
        ("auto", "http://127.0.0.1:8265"),
        ("10.0.0.5:6379", "http://10.0.0.5:8265"),
        ("[fd00::5]:6379", "http://[fd00::5]:8265"),
    ],
)
def test_ray_address_forms_become_the_jobs_api_url(address, url):
    assert ray_cluster.dashboard_url(address) == url


def test_a_dashboard_on_another_port_is_reached_through_the_configured_port():
    assert ray_cluster.dashboard_url("ray-head:6379", dashboard_port=9265) == "http://ray-head:9265"


def test_ensure_cluster_talks_to_the_external_clusters_jobs_api(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(ray_cluster, "_alive", lambda url: asked.append(url) or True)
    cluster = ray_cluster.ensure_cluster(data_dir=Path(tmp_path), address="ray://ray-head:10001")
    assert cluster == ray_cluster.RayCluster(dashboard_url="http://ray-head:8265", local=False)
    assert asked == ["http://ray-head:8265"]


def test_an_unreachable_cluster_is_named_with_the_url_tried(monkeypatch, tmp_path):
    monkeypatch.setattr(ray_cluster, "_alive", lambda url: False)
    with pytest.raises(ray_cluster.RayUnavailable, match=r"ray-head:6379.*http://ray-head:8265"):
        ray_cluster.ensure_cluster(data_dir=Path(tmp_path), address="ray-head:6379")


class FakeJobs:
    def __init__(self):
        self.submitted = []

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)
        return kwargs["submission_id"]


@pytest.mark.parametrize("num_gpus,expected", [(0, None), (1, 1)])
def test_job_drivers_reserve_gpus_only_when_asked(monkeypatch, num_gpus, expected):
    jobs = FakeJobs()
    monkeypatch.setattr(ray_cluster, "_jobs_client", lambda url: jobs)
    cluster = ray_cluster.RayCluster(dashboard_url="http://ray-head:8265", local=False)
    ray_cluster.submit_job(
        cluster, submission_id="j1", entrypoint=["python", "-m", "x"], env={}, num_gpus=num_gpus
    )
    assert jobs.submitted[0]["entrypoint_num_gpus"] == expected
