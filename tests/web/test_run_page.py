"""The run page: charts grouped into panels, a progress line with an ETA, the folded values table."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from webapp.dashboard.charts import chart_layout, latest_values, progress, series

HTMX = {"HX-Request": "true"}
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


# --- panels -----------------------------------------------------------------------------------


def test_metrics_are_grouped_by_prefix_with_reward_and_eval_leading():
    layout = chart_layout(
        [
            "ppo/loss",
            "rollout/reward",
            "eval/accuracy",
            "staleness/max",
            "perf/tokens_per_s",
            "timing/step",
            "timing/inference_stall",
            "weight_sync/bytes",
            "loss/total",
            "rollout/seq_len",
            "correction/kl_k3",
            "distill/reverse_kl",
            "timing/teacher",
            "mystery/thing",
        ]
    )
    assert layout.headline == ["rollout/reward", "eval/accuracy"]
    assert [(p.title, p.metrics) for p in layout.panels] == [
        ("Reward", ["rollout/seq_len"]),
        ("Policy / PPO", ["loss/total", "ppo/loss"]),
        ("Rollout correction", ["correction/kl_k3"]),
        ("Distillation", ["distill/reverse_kl", "timing/teacher"]),
        ("Staleness", ["staleness/max"]),
        ("Weight sync", ["timing/inference_stall", "weight_sync/bytes"]),
        ("Throughput / System", ["perf/tokens_per_s", "timing/step"]),
        ("Other", ["mystery/thing"]),
    ]


def test_without_eval_metrics_the_reward_chart_leads_alone_and_empty_panels_are_left_out():
    layout = chart_layout(["rollout/reward", "ppo/loss"])
    assert layout.headline == ["rollout/reward"]
    assert [p.id for p in layout.panels] == ["policy"]
    assert chart_layout([]).headline == [] and chart_layout([]).panels == []


# --- data and progress ------------------------------------------------------------------------


def test_series_are_columns_per_metric_with_each_steps_first_report_time():
    points = [
        (1, "a", 0.5, T0),
        (1, "b", 1 / 3, T0 + timedelta(seconds=1)),
        (2, "a", 0.25, T0 + timedelta(seconds=7)),
    ]
    data = series(points)
    assert data["series"] == {"a": [[1, 2], [0.5, 0.25]], "b": [[1], [0.333333]]}
    assert data["stepTimes"] == [(1, T0.timestamp()), (2, T0.timestamp() + 7)]
    assert latest_values([(2, "a", 0.25), (1, "b", 1 / 3)]) == [
        {"name": "a", "step": 2, "value": 0.25},
        {"name": "b", "step": 1, "value": 1 / 3},
    ]


def times(*seconds: float, first_step: int = 1) -> list[tuple[int, float]]:
    return [(first_step + i, T0.timestamp() + s) for i, s in enumerate(seconds)]


def test_eta_is_the_steps_left_at_the_median_recent_pace():
    # Steps every 10 s, but one 300 s pause (a restart): the median ignores it.
    step_times = times(0, 10, 20, 320, 330, 340)
    done = progress(step=6, max_steps=16, status="running", step_times=step_times)
    assert done.percent == 37.5 and done.eta_s == 100


def test_eta_looks_at_the_last_ten_intervals_only():
    step_times = times(*[100 * i for i in range(5)]) + times(
        *[500 + 2 * i for i in range(11)], first_step=6
    )
    assert progress(step=16, max_steps=20, status="running", step_times=step_times).eta_s == 8


def test_no_eta_unless_running_with_a_measured_pace_and_steps_left():
    step_times = times(0, 10, 20)
    for status in ("stopped", "interrupted", "queued", "completed"):
        assert progress(step=3, max_steps=10, status=status, step_times=step_times).eta_s is None
    assert progress(step=1, max_steps=10, status="running", step_times=times(0)).eta_s is None
    assert progress(step=10, max_steps=10, status="running", step_times=step_times).eta_s is None
    assert progress(step=3, max_steps=None, status="running", step_times=step_times).eta_s is None
    assert progress(step=12, max_steps=10, status="stopped", step_times=[]).percent == 100


# --- the page ---------------------------------------------------------------------------------


@pytest.fixture
def trained(project, make_run, set_status, db):
    from webapp.runs.models import MetricPoint

    run = make_run(project, name="trained", max_steps=100)
    for step in range(1, 6):
        for name, value in {"rollout/reward": step / 10, "ppo/loss": 0.5, "eval/acc": 0.1}.items():
            MetricPoint.objects.create(
                run=run,
                step=step,
                name=name,
                value=value,
                created_at=T0 + timedelta(seconds=4 * step),
            )
    set_status(run, "running")
    type(run).objects.filter(pk=run.pk).update(step=5)
    run.refresh_from_db()
    return run


def run_url(run) -> str:
    return reverse("dashboard:run", args=[run.project_id, run.id])


def test_run_page_embeds_its_series_and_the_panel_rules_for_the_live_charts(member_client, trained):
    html = member_client.get(run_url(trained)).content.decode()
    data = json.loads(
        re.search(r'<script id="run-data" type="application/json">(.*?)</script>', html, re.S)[1]
    )
    assert data["series"]["rollout/reward"] == [[1, 2, 3, 4, 5], [0.1, 0.2, 0.3, 0.4, 0.5]]
    assert data["maxSteps"] == 100 and len(data["stepTimes"]) == 5
    assert {"id": "staleness", "title": "Staleness", "prefixes": ["staleness/"]} in data["config"][
        "panels"
    ]
    headline = html[html.index('<div class="headline') : html.index('<section class="panel"')]
    assert re.findall(r'data-metric="([^"]+)"', headline) == ["rollout/reward", "eval/acc"]
    assert '<section class="panel" data-panel="policy">' in html


def test_a_long_runs_page_averages_buckets_of_steps_and_keeps_exact_latest_values(
    member_client, project, make_run, set_status
):
    from webapp.dashboard.charts import CHART_MAX_POINTS
    from webapp.runs.models import MetricPoint

    steps = 2 * CHART_MAX_POINTS + 10  # buckets of 3 steps
    run = make_run(project, name="long", max_steps=5000)
    points = [
        MetricPoint(
            run=run, step=s, name="rollout/reward", value=s, created_at=T0 + timedelta(seconds=s)
        )
        for s in range(1, steps + 1)
    ]
    # An eval metric every 100 steps, the last one before the run's last step.
    points += [
        MetricPoint(run=run, step=s, name="eval/acc", value=s / 10000, created_at=T0)
        for s in range(100, steps + 1, 100)
    ]
    MetricPoint.objects.bulk_create(points)
    set_status(run, "running")
    type(run).objects.filter(pk=run.pk).update(step=steps)

    html = member_client.get(run_url(run)).content.decode()
    data = json.loads(
        re.search(r'<script id="run-data" type="application/json">(.*?)</script>', html, re.S)[1]
    )
    shown_steps, values = data["series"]["rollout/reward"]
    assert len(shown_steps) <= CHART_MAX_POINTS + 1
    # Buckets [0, 3), [3, 6), ...: step 1-2 average to 1.5, steps 3-5 to 4, shown at their last step.
    assert (shown_steps[:2], values[:2]) == ([2, 5], [1.5, 4.0])
    last_bucket = range(steps // 3 * 3, steps + 1)
    assert shown_steps[-1] == steps and values[-1] == sum(last_bucket) / len(last_bucket)
    assert f"each point up to step {steps} is the mean of 3 steps" in html
    table = html[html.index('<details id="latest-values">') : html.index("</details>")]
    assert f"<td>rollout/reward</td><td>{steps}</td><td>{steps}.0000</td>" in table
    assert "<td>eval/acc</td><td>2000</td><td>0.2000</td>" in table


def test_run_page_folds_the_latest_values_table(member_client, trained):
    html = member_client.get(run_url(trained)).content.decode()
    table = html[html.index('<details id="latest-values">') : html.index("</details>")]
    assert "3</span> metrics" in table and "<td>0.5000</td>" in table
    assert "<td>eval/acc</td><td>5</td>" in table


def test_status_line_shows_step_of_max_steps_and_the_eta(member_client, trained):
    fragment = member_client.get(run_url(trained), headers=HTMX).content.decode()
    assert fragment.lstrip().startswith('<div id="run-status"')
    assert re.search(r'step <b id="run-step" data-live="step">5</b> / 100', fragment)
    assert '<progress id="run-progress" max="100" value="5">' in fragment
    assert "ETA 6 min 20 s" in fragment  # 95 steps at 4 s
    assert "run-data" not in fragment  # the polled fragment carries no chart data


def test_a_status_the_page_does_not_know_renders_as_a_plain_badge(
    member_client, trained, set_status
):
    set_status(trained, "paused")  # one added later: styled in steep.css, else neutral grey
    html = member_client.get(run_url(trained)).content.decode()
    assert '<span class="badge status-paused" data-live="status">paused</span>' in html
    assert "ETA" not in html[html.index('id="run-status"') : html.index('id="run-live"')]


def test_a_run_without_metrics_says_charts_will_come(member_client, project, make_run):
    html = member_client.get(run_url(make_run(project))).content.decode()
    assert 'id="no-metrics"' in html and '<div class="headline" hidden>' in html
