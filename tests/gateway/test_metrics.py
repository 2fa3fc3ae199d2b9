"""``GET /metrics`` of the live web server: Prometheus's text format (parsed with
prometheus_client's own parser), gateway counters that move by exactly the traffic sent,
429s counted by reason, and gauges that equal what the database holds."""

from __future__ import annotations

import httpx
import pytest
from openai import RateLimitError
from prometheus_client.parser import text_string_to_metric_families

from webapp.gateway.models import Session
from webapp.runs.jobs import job_report_metrics
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]
Samples = dict[tuple[str, frozenset], float]


def scrape(server: str) -> Samples:
    """Every sample of ``{server}/metrics``, by name and labels."""
    response = httpx.get(f"{server}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, metric: str, /, **labels: str) -> float | None:
    return samples.get((metric, frozenset(labels.items())))


def moved(before: Samples, after: Samples, name: str) -> dict[frozenset, float]:
    """How much each series of ``name`` grew between two scrapes (the series that did)."""
    grown = {
        labels: after_value - before.get((sample, labels), 0.0)
        for (sample, labels), after_value in after.items()
        if sample == name
    }
    return {labels: delta for labels, delta in grown.items() if delta}


def series(**labels: str) -> frozenset:
    return frozenset(labels.items())


def test_metrics_parse_and_the_gateway_counters_move_by_exactly_the_traffic_sent(gw, gateway_url):
    before = scrape(gateway_url)
    session_id, key = gw.start_session()
    agent = gw.openai(key)
    for _ in range(2):
        agent.chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert gw.post("/rl/set_reward", {"reward": 1.0}, key=key).status_code == 200
    assert gw.post("/rl/end_session", key=key).status_code == 200
    assert gw.post("/rl/start_session", key="sk-steep-not-a-key").status_code == 401
    models = gw.http.get(f"{gw.base_url}/models", headers={"Authorization": f"Bearer {gw.key}"})
    assert models.status_code == 200  # answered by Django's view, not the fast route
    after = scrape(gateway_url)

    expected = {
        series(endpoint="rl/start_session", status="201"): 1,
        series(endpoint="chat/completions", status="200"): 2,
        series(endpoint="rl/set_reward", status="200"): 1,
        series(endpoint="rl/end_session", status="200"): 1,
        series(endpoint="rl/start_session", status="401"): 1,
        series(endpoint="models", status="200"): 1,
    }
    latency = "steep_gateway_request_duration_seconds"
    assert moved(before, after, "steep_gateway_requests_total") == expected
    assert moved(before, after, f"{latency}_count") == expected
    buckets = moved(before, after, f"{latency}_bucket")  # cumulative: each under +Inf
    inf = ("le", "+Inf")
    assert {labels - {inf}: n for labels, n in buckets.items() if inf in labels} == expected
    assert all(
        n <= expected[labels - {le}]
        for labels, n in buckets.items()
        for le in labels
        if le[0] == "le"
    )
    sums = moved(before, after, f"{latency}_sum")
    assert set(sums) == set(expected) and all(0 < s < 60 for s in sums.values())
    assert moved(before, after, "steep_gateway_refusals_total") == {}


def test_a_full_staleness_budget_is_counted_as_a_refusal_by_reason_on_each_endpoint(
    make_gateway, project, api_key, gateway_url, openai_error
):
    gw = make_gateway(project, api_key, max_staleness=0, batch_size=1)
    gw.start_session()  # the budget's one episode
    before = scrape(gateway_url)
    openai_error(gw.post("/rl/start_session"), 429)
    with pytest.raises(RateLimitError):
        gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    refused = gw.post("/messages", {"max_tokens": 2, "messages": HI})  # Anthropic's shape
    assert refused.status_code == 429 and refused.json()["type"] == "error"
    after = scrape(gateway_url)

    endpoints = ("rl/start_session", "chat/completions", "messages")
    assert moved(before, after, "steep_gateway_refusals_total") == {
        series(endpoint=endpoint, reason="staleness_budget_full"): 1 for endpoint in endpoints
    }
    assert moved(before, after, "steep_gateway_requests_total") == {
        series(endpoint=endpoint, status="429"): 1 for endpoint in endpoints
    }


def test_the_state_gauges_equal_the_databases_counts(gw, gateway_url, engine):
    ready, ready_key = gw.start_session()
    gw.openai(ready_key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=ready_key)
    gw.post("/rl/end_session", key=ready_key)
    unrewarded, unrewarded_key = gw.start_session()
    gw.openai(unrewarded_key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.post("/rl/end_session", key=unrewarded_key)
    gw.start_session()
    gw.start_session()
    for step, seconds, mean, most in ((1, 2.0, 0.25, 1.0), (2, 1.5, 0.5, 2.0)):
        metrics = {"timing/step": seconds, "staleness/mean": mean, "staleness/max": most}
        job_report_metrics(run=gw.run, step=step, version=step - 1, metrics=metrics)

    samples = scrape(gateway_url)
    run = Run.objects.get(pk=gw.run.pk)
    run_id = str(run.id)
    sessions = Session.objects.filter(run=run)
    assert value(samples, "steep_database_up") == 1
    assert (
        value(samples, "steep_sessions_open", run=run_id) == sessions.filter(status="open").count()
    )
    assert sessions.filter(status="open").count() == 2
    by_state = {
        state: value(samples, "steep_trajectories", run=run_id, state=state)
        for state in Session.Trajectory.values
    }
    assert by_state == {
        state: sessions.filter(trajectory=state).count() for state in Session.Trajectory.values
    }
    assert by_state["ready"] == by_state["unrewarded"] == 1 and by_state["pending"] == 2
    for status in Run.Status.values:
        expected = Run.objects.filter(status=status).count()
        assert value(samples, "steep_runs", status=status) == expected, status

    info = {"run": run_id, "name": run.name, "project": "acme", "mode": "online"}
    assert value(samples, "steep_run_info", **info) == 1
    assert value(samples, "steep_run_step", run=run_id) == run.step == 2
    assert value(samples, "steep_run_weight_version", run=run_id) == run.weight_version == 1
    assert value(samples, "steep_run_step_seconds", run=run_id) == 1.5  # the latest step's
    assert value(samples, "steep_run_staleness_mean", run=run_id) == 0.5
    assert value(samples, "steep_run_staleness_max", run=run_id) == 2.0

    server = engine.url
    labels = {"run": run_id, "server": server, "backend": "torch"}
    assert value(samples, "steep_inference_server_healthy", **labels) == 1
    assert value(samples, "steep_inference_server_reporting", server=server) == 1
    assert value(samples, "steep_inference_server_queue_depth", server=server) == 0  # idle
    assert value(samples, "steep_inference_server_running_requests", server=server) == 0
    assert value(samples, "steep_inference_server_tokens_per_second", server=server) >= 0
