"""The run page: charts grouped into panels, a progress line with an ETA, the folded values table."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from webapp.dashboard.charts import (
    ChartLayout,
    Pace,
    chart_layout,
    is_constant,
    latest_values,
    progress,
    series,
)

HTMX = {"HX-Request": "true"}
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


# --- layout ---------------------------------------------------------------------------------


def varying(*names: str) -> dict[str, list[list[float]]]:
    return {name: [[1, 2], [0.1, 0.2]] for name in names}


def flat(value: float, *names: str) -> dict[str, list[list[float]]]:
    return {name: [[1, 2, 3], [value, value, value]] for name in names}


def test_reward_and_eval_lead_then_the_key_panels_then_one_group_per_prefix():
    layout = chart_layout(
        varying(
            "ppo/loss", "rollout/reward", "eval/accuracy", "staleness/max", "staleness/mean",
            "perf/tokens_per_s", "timing/step", "timing/inference_stall", "weight_sync/bytes",
            "loss/total", "rollout/seq_len", "correction/kl_k3", "distill/reverse_kl",
            "ppo/clip_frac", "ppo/approx_kl", "mystery/thing", "my_tool/calls", "loose",
        )
    )  # fmt: skip
    assert layout.headline == ["rollout/reward", "eval/accuracy"]
    assert layout.key == [
        "ppo/approx_kl", "ppo/clip_frac", "distill/reverse_kl", "staleness/mean",
        "perf/tokens_per_s", "timing/step",
    ]  # fmt: skip
    assert [(g.id, g.title, g.charts) for g in layout.groups] == [
        ("rollout", "Rollout", ["rollout/seq_len"]),
        ("ppo", "Policy (PPO)", ["ppo/loss"]),
        ("loss", "Loss", ["loss/total"]),
        ("correction", "Rollout correction", ["correction/kl_k3"]),
        ("staleness", "Staleness", ["staleness/max"]),
        ("weight_sync", "Weight sync", ["weight_sync/bytes"]),
        ("timing", "Timing", ["timing/inference_stall"]),
        ("my_tool", "My tool", ["my_tool/calls"]),  # unknown prefixes after the known, by name
        ("mystery", "Mystery", ["mystery/thing"]),
        ("other", "Other", ["loose"]),  # no prefix
    ]


def test_a_series_that_never_changed_is_a_line_with_its_value_not_a_chart():
    layout = chart_layout(
        varying("ppo/loss") | flat(1e-6, "ppo/lr") | flat(0.0, "ppo/skipped_steps", "timing/step")
    )
    (ppo,) = layout.groups
    assert ppo.charts == ["ppo/loss"]
    assert ppo.constants == [("ppo/lr", "1e-06"), ("ppo/skipped_steps", "0")]
    assert layout.key == ["timing/step"]  # a key panel is drawn, constant or not


def test_counters_are_not_plotted_against_the_step():
    layout = chart_layout(varying("step", "version", "staleness/version", "eval/step", "ppo/loss"))
    assert layout.headline == [] and layout.key == []
    assert [(g.id, g.charts, g.constants) for g in layout.groups] == [("ppo", ["ppo/loss"], [])]


def test_without_eval_metrics_the_reward_chart_leads_alone_and_empty_groups_are_left_out():
    layout = chart_layout(varying("rollout/reward", "ppo/loss"))
    assert layout.headline == ["rollout/reward"]
    assert [g.id for g in layout.groups] == ["ppo"]
    assert chart_layout({}) == ChartLayout([], [], [])


def test_constant_means_equal_to_a_part_in_a_billion():
    assert is_constant([0.3, 0.1 + 0.2]) and is_constant([5.0])
    assert not is_constant([1.0, 1.0001]) and not is_constant([])


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


def test_an_online_run_shows_its_pace_instead_of_an_eta():
    step_times = times(0, 10, 20, 30)  # a step every 10 s: 6 a minute
    started = T0 - timedelta(minutes=5)
    online = progress(
        step=4, max_steps=1_000_000, status="running", step_times=step_times, mode="online",
        trajectories=[8, 8, 16, 16], started_at=started, now=T0 + timedelta(seconds=30),
    )  # fmt: skip
    assert online.eta_s is None and online.pace == Pace(6.0, 72.0)
    assert online.max_steps is None and online.percent is None  # no "/ 1000000", no bar
    assert online.running_s == 330
    bounded = progress(step=4, max_steps=10, status="running", step_times=step_times, mode="online")
    assert bounded.max_steps == 10 and bounded.eta_s is None and bounded.pace == Pace(6.0, None)
    stopped = progress(step=4, max_steps=10, status="stopped", step_times=step_times, mode="online")
    assert stopped.pace is None and stopped.running_s is None


def test_a_dataset_run_whose_end_is_out_of_reach_shows_its_pace_too():
    step_times = times(0, 10, 20)
    near = progress(step=3, max_steps=100, status="running", step_times=step_times)
    assert near.eta_s == 970 and near.pace is None
    far = progress(step=3, max_steps=900_000, status="running", step_times=step_times)
    assert far.eta_s is None and far.pace == Pace(6.0, None)  # 104 days is no forecast
    assert far.max_steps == 900_000  # still within UNBOUNDED_STEPS: a bar


# --- the page ---------------------------------------------------------------------------------


@pytest.fixture
def trained(project, make_run, make_dataset, set_status, db):
    from webapp.runs.models import MetricPoint

    run = make_run(project, name="trained", dataset=make_dataset(project), max_steps=100)
    metrics = {"rollout/reward": 0.1, "ppo/loss": 0.5, "ppo/lr": 1e-6, "eval/acc": 0.1, "step": 0}
    for step in range(1, 6):
        values = metrics | {"rollout/reward": step / 10, "ppo/loss": 0.5 + step, "step": step}
        for name, value in values.items():
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


def test_run_page_embeds_its_series_and_the_layout_rules_for_the_live_charts(
    member_client, trained
):
    html = member_client.get(run_url(trained)).content.decode()
    data = json.loads(
        re.search(r'<script id="run-data" type="application/json">(.*?)</script>', html, re.S)[1]
    )
    assert data["series"]["rollout/reward"] == [[1, 2, 3, 4, 5], [0.1, 0.2, 0.3, 0.4, 0.5]]
    assert data["maxSteps"] == 100 and len(data["stepTimes"]) == 5 and data["mode"] == "dataset"
    assert data["config"]["key"][:2] == ["ppo/approx_kl", "ppo/clip_frac"]
    assert {"id": "staleness", "title": "Staleness"} in data["config"]["groups"]
    assert data["config"]["notPlotted"] == ["step", "version", "staleness/version", "eval/step"]
    headline = html[html.index('<div class="headline') : html.index('id="key-charts"')]
    assert re.findall(r'data-metric="([^"]+)"', headline) == ["rollout/reward", "eval/acc"]
    group = html[html.index('<details class="metric-group" data-group="ppo">') :]
    group = group[: group.index("</details>")]
    assert '<div class="chart" data-metric="ppo/loss"></div>' in group
    assert 'data-metric="ppo/lr"><span class="constant-name">ppo/lr</span>' in group
    assert "1e-06</b>" in group and "1 chart · 1 constant" in group
    assert (
        'data-metric="step"'
        not in html[html.index('id="run-live"') : html.index('id="latest-values"')]
    )


def latest_values_table(html: str) -> str:
    start = html.index('<details class="fold" id="latest-values">')
    return html[start : html.index("</details>", start)]


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
    table = latest_values_table(html)
    assert f"<td>rollout/reward</td><td>{steps}</td><td>{steps}.0000</td>" in table
    assert "<td>eval/acc</td><td>2000</td><td>0.2000</td>" in table


def test_run_page_folds_the_latest_values_table(member_client, trained):
    html = member_client.get(run_url(trained)).content.decode()
    table = latest_values_table(html)
    assert "5</span> metrics" in table and "<td>5.5000</td>" in table
    assert "<td>eval/acc</td><td>5</td>" in table


def test_status_line_shows_step_of_max_steps_and_the_eta(member_client, trained):
    fragment = member_client.get(run_url(trained), headers=HTMX).content.decode()
    assert fragment.lstrip().startswith('<div id="run-status"')
    assert re.search(r'step <b id="run-step" data-live="step">5</b> / 100', fragment)
    assert '<progress id="run-progress" max="100" value="5">' in fragment
    assert "ETA 6 min 20 s" in fragment  # 95 steps at 4 s
    assert "run-data" not in fragment  # the polled fragment carries no chart data


def test_an_online_runs_status_line_shows_its_pace_and_how_long_it_has_run(
    member_client, project, make_run, set_status
):
    from django.utils import timezone

    from webapp.runs.models import MetricPoint

    run = make_run(project, name="online", max_steps=1_000_000)
    start = timezone.now() - timedelta(minutes=2)
    MetricPoint.objects.bulk_create(
        MetricPoint(
            run=run,
            step=step,
            name=name,
            value=8.0,
            created_at=start + timedelta(seconds=10 * step),
        )
        for step in range(1, 5)
        for name in ("rollout/num_trajectories", "rollout/reward")
    )
    set_status(run, "running")
    type(run).objects.filter(pk=run.pk).update(step=4, started_at=start)
    fragment = member_client.get(run_url(run), headers=HTMX).content.decode()
    assert re.search(r'step <b id="run-step" data-live="step">4</b></span>', fragment)
    assert (
        '<span class="pace" data-live="pace">6 steps/min · 48 trajectories/min</span>' in fragment
    )
    assert "ETA" not in fragment and "1000000" not in fragment and "<progress" not in fragment
    assert re.search(r"running for \d+ min \d\d s", fragment)  # since started_at


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
