"""The run page of a run that reports what a real GRPO run reports (60 metrics), in a real browser:
the key panels first, the rest folded by group, constants as one line, a filter, pins that a
reload keeps, pace instead of an ETA for an online run, and every table and control in reach at
a desktop (1400 px) and a phone (390 px) width. Screenshots go where test_console_layout puts
them (``.steep/screenshots/run-metrics-<width>.png``)."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest
from playwright.sync_api import expect

from tests.browser.fit import assert_fits
from tests.browser.test_console_layout import SHOTS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

STEP_SECONDS = 6
KEY = [  # webapp.dashboard.charts.KEY_METRICS present in the run below, in page order
    "ppo/approx_kl",
    "ppo/clip_frac",
    "staleness/mean",
    "perf/tokens_per_s",
    "timing/step",
]
CONSTANT = {  # name: the value it keeps
    "ppo/lr": 1e-6,
    "ppo/skipped_steps": 0.0,
    "ppo/dual_clip_frac": 0.0,
    "ppo/behav_masked_frac": 0.0,
    "rollout/num_trajectories": 32.0,
    "rollout/truncated_frac": 0.0,
    "rollout/reward_error_frac": 0.0,
    "staleness/dropped": 0.0,
    "staleness/masked_tokens": 0.0,
    "staleness/rejected": 0.0,
    "staleness/dropped_total": 0.0,
    "staleness/capacity": 64.0,
    "staleness/mixed_version_frac": 0.0,
    "timing/inference_stall": 0.0,
    "weight_sync/requests_moved": 0.0,
    "perf/peak_memory_gb": 3.5,
}


def metrics_at(step: int) -> dict[str, float]:
    """One step of the metrics rl_core's loop, trainer, loss and staleness controller report."""
    w = math.sin(step * 1.3)
    varying = {
        "step": float(step),
        "rollout/reward": 0.8 * (1 - math.exp(-step / 15)) + 0.05 * w,
        "rollout/reward_std": 0.3 + 0.04 * w,
        "rollout/response_tokens": 120 + 10 * w,
        "rollout/seq_len": 300 + 12 * w,
        "rollout/logprob_gap": 0.01 + 0.002 * w,
        "rollout/logprob_gap_max": 0.2 + 0.05 * w,
        "ppo/loss": 0.02 * w,
        "ppo/pg_loss": 0.018 * w,
        "ppo/clip_frac": 0.04 + 0.01 * w,
        "ppo/approx_kl": 0.002 + 0.0005 * w,
        "ppo/ratio_mean": 1 + 0.001 * w,
        "ppo/behav_imp_weight": 1 + 0.01 * w,
        "ppo/behav_imp_weight_max": 1.4 + 0.1 * w,
        "ppo/entropy": 1.9 - step / 80,
        "ppo/grad_norm": 0.5 + 0.1 * w,
        "staleness/max": float(step % 3),
        "staleness/mean": (step % 3) / 2,
        "staleness/version": float(step),
        "staleness/accepted": 32.0 * step,
        "staleness/running": 20 + 4 * w,
        "timing/step": STEP_SECONDS + 0.4 * w,
        "timing/wait_batch": 1.2 + 0.3 * w,
        "timing/train_step": 3.9 + 0.2 * w,
        "timing/weight_sync": 0.7 + 0.05 * w,
        "timing/weight_transfer": 0.5 + 0.05 * w,
        "timing/save_weights": 0.2 + 0.01 * w,
        "timing/report": 0.02 + 0.001 * w,
        "perf/tokens_per_s": 11800 + 600 * w,
        "perf/step_s": 3.9 + 0.2 * w,
        "perf/trajectories_per_s": 5.3 + 0.2 * w,
        "perf/computed_tokens_per_token": 1.1 + 0.01 * w,
        "weight_sync/bytes": 9.9e8 + 1e6 * w,
        "correction/kl_k3": 0.001 + 0.0002 * w,
        "correction/log_ratio_mean": 0.0004 * w,
        "custom/tool_calls": 2 + w,
        "custom/answer_len": 40 + 5 * w,
        "custom/judge_score": 6 + w,
        "custom/format_ok": 0.9 + 0.05 * w,
        "custom/turns": 3 + 0.5 * w,
        "ppo/kl_ref": 0.01 + 0.001 * step,
        "timing/update_weights": 0.3 + 0.02 * w,
    }
    values = varying | CONSTANT
    if step % 10 == 0:
        values |= {"eval/mean_reward": 0.2 + step / 100, "eval/pass_at_k": 0.4 + step / 200}
    return values


METRIC_NAMES = sorted(set(metrics_at(10)))
assert len(METRIC_NAMES) == 60  # what the issue counted on a real run's page (59, and eval/)


@pytest.fixture
def make_reporting_run(project, make_run, make_dataset):
    """A running run ``steps`` steps in, a step every 6 s, the last one just now."""
    from django.utils import timezone

    from webapp.runs.models import Checkpoint, MetricPoint, Run

    def make(name: str, *, online: bool = False, max_steps: int = 100, steps: int = 60):
        dataset = None if online else make_dataset(project, name=f"{name}-rows")
        run = make_run(project, name=name, dataset=dataset, max_steps=max_steps)
        start = timezone.now() - timedelta(seconds=STEP_SECONDS * steps)
        MetricPoint.objects.bulk_create(
            MetricPoint(
                run=run,
                step=step,
                name=metric,
                value=value,
                created_at=start + timedelta(seconds=STEP_SECONDS * step),
            )
            for step in range(1, steps + 1)
            for metric, value in metrics_at(step).items()
        )
        for step in (20, 40, 60):  # one exported (a long path), one failed, one not yet
            Checkpoint.objects.create(
                run=run,
                version=step,
                step=step,
                path=f"/data/runs/{run.id}/checkpoints/step-{step}",
                size_bytes=987_654_321,
                **{
                    20: {"export_status": "done", "export_path": f"/data/exports/{run.id}/step-20"},
                    40: {"export_status": "failed", "export_error": "disk full"},
                    60: {},
                }[step],
            )
        Run.objects.filter(pk=run.pk).update(
            status="running", step=steps, weight_version=steps, started_at=start
        )
        run.refresh_from_db()
        return run

    return make


def run_url(live_server, run) -> str:
    return f"{live_server.url}/projects/{run.project_id}/runs/{run.id}/"


def chart(metric: str) -> str:
    return f'.chart[data-metric="{metric}"]'


def constant(metric: str) -> str:
    return f'.constant[data-metric="{metric}"]'


def group(prefix: str) -> str:
    return f'.metric-group[data-group="{prefix}"]'


def open_run(page, url: str, width: int = 1400) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(url)
    page.wait_for_selector("#run-live[data-ready='1']")
    page.wait_for_selector(f"{chart('rollout/reward')} canvas")


def shown_metrics(page, selector: str = "[data-metric]") -> list[str]:
    """The metrics of the charts and constant lines a person can see, in page order."""
    return page.locator(f"#run-live :is(.chart, .constant){selector}").evaluate_all(
        "els => els.filter(e => e.checkVisibility()).map(e => e.dataset.metric)"
    )


def test_run_page_leads_with_the_reward_and_the_key_panels_and_folds_the_rest_by_group(
    logged_in, live_server, make_reporting_run
):
    page = logged_in
    open_run(page, run_url(live_server, make_reporting_run("gsm8k-grpo")))

    # What is in sight: the reward beside the evals, then the key panels, in that order.
    headline = ["rollout/reward", "eval/mean_reward", "eval/pass_at_k"]
    assert shown_metrics(page) == headline + KEY
    assert page.locator(".headline .chart").evaluate_all("e => e.map(b => b.dataset.metric)") == (
        headline
    )
    assert page.locator("#key-charts .chart").evaluate_all("e => e.map(b => b.dataset.metric)") == (
        KEY
    )
    charts = page.locator("#key-charts .chart").all()
    key_bottom = max(b["y"] + b["height"] for b in (c.bounding_box() for c in charts))
    assert page.locator(".metric-group").first.bounding_box()["y"] >= key_bottom
    assert page.locator(chart("rollout/reward")).bounding_box()["y"] < 500  # above the fold

    # Everything else is folded, one group per prefix, known ones first.
    groups = page.locator(".metric-group")
    assert groups.evaluate_all("gs => gs.map(g => g.dataset.group)") == [
        "rollout", "ppo", "correction", "staleness", "weight_sync", "perf", "timing", "custom",
    ]  # fmt: skip
    assert groups.evaluate_all("gs => gs.every(g => !g.open)")
    assert text(page, f"{group('custom')} summary") == "Custom 5 charts"
    assert text(page, f"{group('ppo')} summary") == ("Policy (PPO) 8 charts · 4 constant")
    for name in METRIC_NAMES:  # each metric in one place, in its prefix's group if folded
        placed = page.locator(f'#run-live :is(.chart, .constant)[data-metric="{name}"]')
        if name in ("step", "staleness/version"):  # counters: no chart against the step
            assert placed.count() == 0
            continue
        assert placed.count() == 1, name
        if name not in headline + KEY:
            assert (
                placed.evaluate("e => e.closest('.metric-group').dataset.group")
                == (name.split("/")[0])
            )
    # Only what is in sight is drawn; a group draws its charts when it opens.
    assert page.locator("#run-live canvas").count() == len(headline + KEY)
    page.click(f"{group('timing')} summary")
    expect(page.locator(f"{group('timing')} .chart canvas")).to_have_count(7)


def test_constant_series_read_as_one_line_with_their_value(
    logged_in, live_server, make_reporting_run
):
    page = logged_in
    open_run(page, run_url(live_server, make_reporting_run("constants")))
    lines = page.locator("#run-live .constant")
    assert sorted(lines.evaluate_all("e => e.map(l => l.dataset.metric)")) == sorted(CONSTANT)
    for name in CONSTANT:  # no chart of a flat line
        assert page.locator(chart(name)).count() == 0
    page.click(f"{group('ppo')} summary")
    assert text(page, constant("ppo/lr")) == "ppo/lr: 1e-6 (constant)"
    page.click(f"{group('staleness')} summary")
    assert text(page, constant("staleness/capacity")) == ("staleness/capacity: 64 (constant)")
    line = box(page, constant("staleness/capacity"))
    assert line["height"] < 40  # one line, not a 190 px chart


def test_the_filter_box_shows_only_the_panels_whose_name_matches(
    logged_in, live_server, make_reporting_run
):
    page = logged_in
    open_run(page, run_url(live_server, make_reporting_run("filtered")))
    page.fill("#metric-filter", "kl")
    assert shown_metrics(page) == ["ppo/approx_kl", "ppo/kl_ref", "correction/kl_k3"]
    assert page.locator(".metric-group:visible").evaluate_all("gs => gs.map(g => g.dataset.group)") == [
        "ppo", "correction",
    ]  # fmt: skip
    expect(page.locator(f"{chart('ppo/kl_ref')} canvas")).to_have_count(1)  # its group opened
    page.fill("#metric-filter", "timing step")  # every word in the name
    assert shown_metrics(page) == ["timing/step", "timing/train_step"]
    page.fill("#metric-filter", "no such metric")
    expect(page.locator("#filter-empty")).to_be_visible()
    assert shown_metrics(page) == []
    page.fill("#metric-filter", "")
    assert "rollout/reward" in shown_metrics(page)
    assert page.locator(".metric-group").evaluate_all("gs => gs.every(g => !g.open && !g.hidden)")
    expect(page.locator("#filter-empty")).to_be_hidden()


def test_a_pinned_panel_joins_the_key_panels_and_stays_there_after_a_reload(
    logged_in, live_server, make_reporting_run
):
    page = logged_in
    url = run_url(live_server, make_reporting_run("pins"))
    open_run(page, url)
    page.click(f"{group('ppo')} summary")
    page.click(f"{chart('ppo/entropy')} button.pin")
    page.click(f"{constant('ppo/lr')} button.pin")  # a constant pinned is drawn
    page.click(f"{chart('ppo/clip_frac')} button.pin")  # a default key panel unpinned
    expected = ["ppo/approx_kl", "staleness/mean", "perf/tokens_per_s", "timing/step", "ppo/entropy", "ppo/lr"]  # fmt: skip
    for _ in range(2):  # now, and after a reload
        keys = page.locator("#key-charts .chart")
        assert keys.evaluate_all("e => e.map(b => b.dataset.metric)") == expected
        expect(page.locator(f"#key-charts {chart('ppo/lr')} canvas")).to_have_count(1)
        assert page.get_attribute(f"{chart('ppo/entropy')} button.pin", "aria-pressed") == "true"
        assert page.locator(f"{group('ppo')} {chart('ppo/clip_frac')}").count() == 1
        assert page.get_attribute(f"{chart('ppo/clip_frac')} button.pin", "aria-pressed") == "false"
        low, high = map(float, page.get_attribute(chart("ppo/lr"), "data-y-range").split(","))
        assert low == pytest.approx(0.9e-6) and high == pytest.approx(1.1e-6)  # around its value
        open_run(page, url)
    page.click(f"#key-charts {chart('ppo/lr')} button.pin")  # unpinned: a line again
    expect(page.locator(f"{group('ppo')} {constant('ppo/lr')}")).to_have_count(1)


def test_an_online_run_shows_its_pace_where_a_dataset_run_shows_its_eta(
    logged_in, live_server, make_reporting_run
):
    page = logged_in
    online = make_reporting_run("online", online=True, max_steps=1_000_000)
    open_run(page, run_url(live_server, online))
    line = page.locator("#run-status .progress-line")
    # A step every 6 s, 32 trajectories a step; started 60 steps (6 min) ago.
    expect(line).to_contain_text("step 60")
    assert "1000000" not in line.inner_text() and "ETA" not in line.inner_text()
    assert page.locator('[data-live="pace"]').inner_text() == "10 steps/min · 320 trajectories/min"
    expect(page.locator("#run-uptime")).to_have_text(re.compile(r"running for \d+ min \d\d s"))
    assert page.locator("#run-progress").count() == 0

    open_run(page, run_url(live_server, make_reporting_run("dataset")))
    assert page.locator('[data-live="eta"]').inner_text() == "ETA 4 min 00 s"  # 40 steps × 6 s
    assert page.locator('[data-live="pace"]').inner_text() == ""
    assert page.get_attribute("#run-progress", "value") == "60"


def test_metrics_arriving_live_land_in_their_group(logged_in, live_server, make_reporting_run):
    """The websocket (played here by Playwright) brings a new step: a metric never seen lands in
    its prefix's group (a new group when the prefix is new), a constant that starts to vary
    becomes a chart, and the pace follows the new step."""
    import json

    page = logged_in
    run = make_reporting_run("live", online=True, max_steps=1_000_000)
    sockets = []
    page.route_web_socket("**/ws/runs/**", lambda ws: sockets.append(ws))
    open_run(page, run_url(live_server, run))
    page.wait_for_function("document.getElementById('run-live').dataset.connected === '1'")
    t = page.evaluate(
        "JSON.parse(document.getElementById('run-data').textContent).stepTimes.at(-1)[1]"
    )

    def step(n: int, values: dict[str, float]) -> None:
        points = [
            {"step": n, "name": k, "value": v, "t": t + 6 * (n - 60)} for k, v in values.items()
        ]
        sockets[0].send(
            json.dumps({"type": "metrics", "points": points, "step": n, "weight_version": n})
        )
        page.wait_for_function(f"document.getElementById('run-live').dataset.lastStep === '{n}'")

    step(
        61,
        {"rollout/reward": 0.9, "tools/calls": 3.0, "ppo/lr": 2e-6, "rollout/num_trajectories": 32},
    )
    assert page.locator(f"{group('tools')} {constant('tools/calls')}").count() == 1
    assert page.locator(".metric-group").evaluate_all("gs => gs.map(g => g.dataset.group)")[-2:] == [
        "custom", "tools",
    ]  # fmt: skip
    assert text(page, f"{group('tools')} summary") == "Tools 1 constant"
    assert page.locator(f"{group('ppo')} {chart('ppo/lr')}").count() == 1  # it varies now
    assert text(page, f"{group('ppo')} summary") == ("Policy (PPO) 9 charts · 3 constant")
    step(62, {"tools/calls": 5.0, "rollout/num_trajectories": 32})
    assert text(page, f"{group('tools')} summary") == "Tools 1 chart"
    page.click(f"{group('tools')} summary")
    expect(page.locator(f"{chart('tools/calls')} canvas")).to_have_count(1)
    assert text(page, f"{chart('tools/calls')} .chart-value") == "5 step 62"
    assert text(page, f"{chart('rollout/reward')} .chart-value") == "0.9 step 61"
    assert page.locator('[data-live="pace"]').inner_text() == "10 steps/min · 320 trajectories/min"
    page.fill("#metric-filter", "reward")  # the filter holds for what comes next
    step(63, {"tools/calls": 4.0, "rollout/reward_mean_new": 0.5})
    assert shown_metrics(page) == [
        "rollout/reward", "eval/mean_reward",  # the group's charts, then its constant lines
        "rollout/reward_std", "rollout/reward_error_frac", "rollout/reward_mean_new",
    ]  # fmt: skip


def test_run_page_tables_and_controls_fit_a_desktop_and_a_phone(
    logged_in, live_server, make_reporting_run
):
    page = logged_in
    url = run_url(live_server, make_reporting_run("gsm8k-grpo"))
    SHOTS.mkdir(parents=True, exist_ok=True)
    heights = {}
    for width in (1400, 390):
        open_run(page, url, width)
        page.wait_for_timeout(300)  # charts resize to their boxes on the next frame
        heights[width] = page.evaluate("document.scrollingElement.scrollHeight")
        page.screenshot(path=str(SHOTS / f"run-metrics-{width}.png"), full_page=True)
        assert_fits(page)
        folded = page.locator("details.fold").evaluate_all(
            "ds => ds.filter(d => !d.open).map(d => d.id)"
        )
        if width == 390:  # a phone gets a summary: the sections under the charts start folded
            assert {"fold-sessions", "fold-evals", "fold-checkpoints", "fold-agents"} <= set(folded)
        else:
            assert "fold-checkpoints" not in folded and "fold-evals" not in folded
        page.locator("details").evaluate_all("ds => ds.forEach(d => { d.open = true; })")
        page.wait_for_timeout(300)
        assert_fits(page)  # unfolded, all of it still fits
        download = box(page, "#run-checkpoints a:has-text('Download (zip)')")
        assert (
            download["x"] + download["width"]
            <= box(page, "#run-checkpoints")["x"] + box(page, "#run-checkpoints")["width"]
        )
        # The Evaluate form: each checkbox inside its own label, the labels apart.
        choices = [box(page, f"#eval-form .choice >> nth={i}") for i in range(4)]
        for a, b in zip(choices, choices[1:], strict=False):
            assert b["x"] >= a["x"] + a["width"] + 4 or b["y"] >= a["y"] + a["height"]
        boxes = page.locator("#eval-form .choice input").evaluate_all(
            "ins => ins.map(i => [i.getBoundingClientRect(), i.closest('label').getBoundingClientRect()])"
            ".every(([i, l]) => i.left >= l.left && i.right <= l.right)"
        )
        assert boxes
        page.screenshot(path=str(SHOTS / f"run-metrics-open-{width}.png"), full_page=True)
    print(f"run page height: {heights[1400]} px at 1400 px, {heights[390]} px at 390 px")
    assert heights[390] < 5000  # was 14,183 px with every metric a chart


def text(page, selector: str) -> str:
    """What the element reads, as one line."""
    return " ".join(page.locator(selector).first.text_content().split())


def box(page, selector: str) -> dict:
    return page.locator(selector).first.bounding_box()
