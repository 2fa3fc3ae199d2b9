"""The monitoring profile: Prometheus scraping what Steep serves, Grafana charting only
metrics Steep exports, and docs/metrics.md naming every one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from webapp.metrics import instruments
from webapp.metrics.tasks import TASK_DURATION, TASKS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "steep-dashboard.json"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def documented() -> set[str]:
    """The metric names in docs/metrics.md's tables."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    return {
        name
        for first_cell in re.findall(r"^\| (`steep_.*?) \|", text, re.M)
        for name in re.findall(r"`(steep_[a-z_]+)`", first_cell)
    }


def family(name: str) -> str:
    return re.sub(r"_(total|bucket|count|sum)$", "", name)


def test_the_monitoring_profile_runs_prometheus_and_grafana_on_the_loopback(services):
    for name in ("prometheus", "grafana"):
        service = services[name]
        assert service["profiles"] == ["monitoring"], name
        assert all(port.startswith("127.0.0.1:") for port in service["ports"]), name
        image, _, tag = service["image"].partition(":")
        assert tag and tag != "latest", name
    assert (
        "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
        in services["prometheus"]["volumes"]
    )
    mounts = " ".join(services["grafana"]["volumes"])
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    assert "./deploy/grafana/steep-dashboard.json:" in mounts
    provider = yaml.safe_load(
        (ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "steep.yml").read_text()
    )
    assert any(
        mount.split(":")[1].startswith(provider["providers"][0]["options"]["path"] + "/")
        for mount in services["grafana"]["volumes"]
        if "steep-dashboard.json" in mount
    )


def test_prometheus_scrapes_the_web_and_the_worker_where_they_serve(services):
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {
        name: {(n, sd["port"]) for sd in job["dns_sd_configs"] for n in sd["names"]}
        for name, job in jobs.items()
    }
    assert targets == {"steep-web": {("web", 8000)}, "steep-worker": {("worker", 9808)}}
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())
    assert (
        services["worker"]["environment"]["WORKER_METRICS_PORT"] == "${WORKER_METRICS_PORT:-9808}"
    )
    assert "--port=8000" in services["web"]["command"]


def test_the_dashboard_charts_only_metrics_steep_exports_and_documents():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert exprs
    charted = {family(name) for expr in exprs for name in re.findall(r"\bsteep_[a-z_]+", expr)}
    assert charted <= {family(name) for name in documented()}, charted - documented()
    assert {"steep_gateway_refusals", "steep_trajectories", "steep_run_staleness_mean"} <= charted
    uids = [dashboard["uid"]] + [p["id"] for p in dashboard["panels"]]
    assert len(set(uids)) == len(uids)


@pytest.mark.django_db
def test_docs_list_every_metric_steep_exports(client):
    scraped = {
        metric.name
        for metric in text_string_to_metric_families(client.get("/metrics").content.decode())
    }
    ours = {name for name in scraped if name.startswith("steep_")}
    counted = {metric._name for metric in (*instruments.METRICS, TASKS, TASK_DURATION)}
    assert {"steep_gateway_requests", "steep_trajectories", "steep_database_up"} <= ours | counted
    assert {family(name) for name in documented()} == ours | counted
