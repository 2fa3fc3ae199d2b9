"""The console in a real browser at a desktop (1400 px) and a phone (390 px) width.

Every page checked here is also saved as a full-page PNG in ``.steep/screenshots/`` (or
``$STEEP_SCREENSHOT_DIR``), named ``<page>-<width>.png``, so anyone can look at the pages.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("STEEP_SCREENSHOT_DIR") or ROOT / ".steep" / "screenshots")
WIDTHS = {"desktop": 1400, "phone": 390}
STEP_SECONDS = 7  # the fixture run reports a step every 7 s
USER = {"role": "user"}


def metrics_at(step: int, *, with_eval: bool) -> dict[str, float]:
    """A plausible step of a GRPO run's metrics: a rising reward, constant and all-zero series."""
    wave = math.sin(step * 1.7)
    values = {
        "rollout/reward": 0.75 * (1 - math.exp(-step / 20)) + 0.06 * wave,
        "rollout/reward_std": 0.3 + 0.05 * math.cos(step),
        "rollout/seq_len": 180 + 20 * math.sin(step / 5),
        "rollout/truncated_frac": 0.0,
        "rollout/num_trajectories": 32.0,
        "ppo/loss": 0.02 * wave - 0.01,
        "ppo/pg_loss": 0.02 * wave - 0.012,
        "ppo/clip_frac": 0.03 + 0.01 * wave,
        "ppo/approx_kl": 0.001 + 0.0004 * wave,
        "ppo/entropy": 1.8 - step / 100,
        "ppo/grad_norm": 0.6 + 0.2 * wave,
        "ppo/lr": 1e-6,
        "ppo/behav_imp_weight": 1.0 + 0.01 * wave,
        "ppo/behav_masked_frac": 0.0,
        "ppo/n_tokens": 2048 + 100 * wave,
        "staleness/max": float(step % 3),
        "staleness/mean": (step % 3) / 2,
        "staleness/dropped": 0.0,
        "staleness/version": float(step),
        "timing/step": STEP_SECONDS + 0.3 * wave,
        "timing/train_step": 4.2 + 0.2 * wave,
        "timing/wait_batch": 1.5 + 0.3 * wave,
        "timing/weight_sync": 0.8,
        "perf/tokens_per_s": 12345.6 + 800 * wave,
        "perf/trajectories_per_s": 4.5 + 0.2 * wave,
        "sessions/open": 12.0,
        "custom/my_signal": 3.0 + wave,
    }
    if with_eval and step % 10 == 0:
        values["eval/accuracy"] = 0.2 + step / 100
    return values


@pytest.fixture
def make_trained_run(project, make_run):
    """A running run 60 steps into 100, a step every 7 s, the last one just now."""
    from django.utils import timezone

    from webapp.runs.models import MetricPoint, Run

    def make(name: str, *, with_eval: bool, steps: int = 60):
        run = make_run(project, name=name, max_steps=100)
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
            for metric, value in metrics_at(step, with_eval=with_eval).items()
        )
        Run.objects.filter(pk=run.pk).update(status="running", step=steps, weight_version=steps)
        run.refresh_from_db()
        return run

    return make


def look(page, url: str, name: str, *, ready: str) -> dict[str, int]:
    """Open ``url`` at each width, wait for ``ready``, save a screenshot; the page's sizes by width."""
    sizes = {}
    SHOTS.mkdir(parents=True, exist_ok=True)
    for label, width in WIDTHS.items():
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(url)
        page.wait_for_selector(ready)
        page.wait_for_timeout(300)  # charts resize to their boxes on the next frame
        scroll_width, height = page.evaluate(
            "[document.scrollingElement.scrollWidth, document.scrollingElement.scrollHeight]"
        )
        assert scroll_width <= width, f"{name} overflows sideways at {width} px: {scroll_width}"
        page.screenshot(path=str(SHOTS / f"{name}-{width}.png"), full_page=True)
        sizes[label] = height
    return sizes


def box(page, selector: str) -> dict:
    return page.locator(selector).first.bounding_box()


def chart(metric: str) -> str:
    return f'.chart[data-metric="{metric}"]'


def test_run_page_leads_with_progress_and_lays_charts_out_in_panels(
    logged_in, live_server, project, make_trained_run
):
    page = logged_in
    run = make_trained_run("gsm8k-grpo", with_eval=True)
    url = f"{live_server.url}/projects/{project.id}/runs/{run.id}/"
    heights = look(page, url, "run", ready=f"{chart('perf/tokens_per_s')} canvas")
    assert heights["desktop"] < 5000  # was ~9,700 px: one column of charts under a 60-row table

    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(url)
    page.wait_for_selector(f"{chart('rollout/reward')} canvas")
    summary = page.locator("#run-status").inner_text()
    assert "step 60 / 100" in summary
    # An online run: its pace (a step every 7 s, 32 trajectories a step), not an ETA.
    assert page.locator('[data-live="pace"]').inner_text() == "8.6 steps/min · 274 trajectories/min"
    assert page.locator('[data-live="eta"]').inner_text() == ""
    assert page.get_attribute("#run-progress", "value") == "60"

    # The reward and eval charts lead, side by side; the key panels follow in a row.
    reward, evals = box(page, chart("rollout/reward")), box(page, chart("eval/accuracy"))
    assert reward["y"] == evals["y"] and evals["x"] > reward["x"] + reward["width"] / 2
    assert reward["y"] < 600  # above the fold
    first, second = page.locator("#key-charts .chart").all()[:2]
    a, b = first.bounding_box(), second.bounding_box()
    assert a["y"] == b["y"] and b["x"] >= a["x"] + a["width"]
    # The rest is folded, one group per metric-name prefix (tests/browser/test_run_page_browser.py).
    titles = page.locator(".metric-group .group-title").all_inner_texts()
    assert titles == ["Rollout", "Policy (PPO)", "Staleness", "Throughput", "Timing", "Sessions", "Custom"]  # fmt: skip
    assert (
        page.locator(f'.metric-group[data-group="custom"] {chart("custom/my_signal")}').count() == 1
    )

    # The latest-values table is there, folded.
    assert page.locator("#latest-values").get_attribute("open") is None
    assert page.locator("#metrics-table tbody tr").count() == len(metrics_at(60, with_eval=True))

    # Legends read the latest value; constant and all-zero series are one line with it.
    head = page.locator(f"{chart('ppo/approx_kl')} .chart-value").text_content()
    assert " ".join(head.split()) == "0.001398 step 60"
    page.click('.metric-group[data-group="sessions"] summary')
    line = page.locator('.constant[data-metric="sessions/open"]').text_content()
    assert " ".join(line.split()) == "sessions/open: 12 (constant)"


def test_run_page_charts_smooth_and_switch_to_a_time_axis(
    logged_in, live_server, project, make_trained_run
):
    page = logged_in
    run = make_trained_run("toggles", with_eval=False)
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(f"{live_server.url}/projects/{project.id}/runs/{run.id}/")
    page.wait_for_selector(f"{chart('rollout/reward')} canvas")
    # Without eval metrics the reward chart has the headline row to itself: no empty box.
    assert page.locator(".headline .chart").count() == 1
    headline = box(page, ".headline")
    assert box(page, chart("rollout/reward"))["width"] > headline["width"] * 0.95

    value = page.locator(f"{chart('rollout/reward')} .chart-value .muted")
    assert value.inner_text() == "step 60"
    page.click("button[data-x-axis=time]")
    assert page.get_attribute("button[data-x-axis=time]", "aria-pressed") == "true"
    assert not value.inner_text().startswith("step")  # the last point's clock time
    page.fill("#smoothing", "0.9")
    page.dispatch_event("#smoothing", "input")
    assert page.locator("#smoothing-value").inner_text() == "0.90"
    page.reload()  # both choices are remembered
    page.wait_for_selector(f"{chart('rollout/reward')} canvas")
    assert page.get_attribute("button[data-x-axis=time]", "aria-pressed") == "true"
    assert page.locator("#smoothing-value").inner_text() == "0.90"


def test_run_page_without_metrics_says_so_instead_of_empty_charts(
    logged_in, live_server, project, make_run
):
    page = logged_in
    run = make_run(project, name="fresh")
    page.goto(f"{live_server.url}/projects/{project.id}/runs/{run.id}/")
    assert page.locator("#no-metrics").is_visible()
    assert not page.locator(".headline").is_visible()
    assert page.locator(".chart").count() == 0


@pytest.fixture
def recorded(project, make_run, make_agent, make_session, tokenizer_dir):
    run = make_run(project, name="online", base_model=str(tokenizer_dir))
    agent = make_agent(project, name="solver", run=run)
    session = make_session(
        agent,
        [
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    USER | {"content": "What is 2 + 2?"},
                ],
                "answer": "It is 4.",
                "versions": 3,
                "reward": 0.5,
            },
            {
                "messages": [USER | {"content": "And times 3?"}],
                "answer": "That makes 12, since 4 times 3 is 12.",
                "versions": (3, 4, 12),
                "reward": 1.0,
            },
        ],
        task_id="arith-1",
        metadata={"split": "train"},
        admitted_version=3,
    )
    make_session(agent, [{"messages": [USER | {"content": "Name a prime."}], "answer": "7"}])
    return session


def test_session_page_tokens_have_a_palette_a_legend_and_a_hover_card(
    logged_in, live_server, project, recorded
):
    page = logged_in
    url = f"{live_server.url}/projects/{project.id}/sessions/{recorded.id}/"
    look(page, url, "session", ready="#version-legend")

    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(url)
    legend = page.locator("#version-legend .tok").all_inner_texts()
    assert legend == ["v3", "v4", "prompt"]

    def background(selector: str) -> str:
        return page.locator(selector).first.evaluate("el => getComputedStyle(el).backgroundColor")

    answer = "#turn-1 .answer .tok"
    assert background(f'{answer}[data-version="3"]') != background(f'{answer}[data-version="4"]')
    page.click("#turn-1 .prompt-tokens summary")
    assert background("#turn-1 .prompt-tokens .tok") not in {
        background(f'{answer}[data-version="3"]'),
        background(f'{answer}[data-version="4"]'),
    }

    token = page.locator(f'{answer}[data-version="4"]').first
    token.hover()
    card = page.locator("#tok-card")
    facts = card.locator("dd")  # id, logprob, version
    expect(card).to_be_visible()
    expect(facts.nth(0)).to_have_text(token.get_attribute("data-id"))
    expect(facts.nth(1)).to_contain_text(f"{float(token.get_attribute('data-lp')):.4f}")
    expect(facts.nth(2)).to_have_text("v4")
    expect(card.locator(".tok-card-text")).to_have_text(token.inner_text().replace(" ", "␣"))

    # Keyboard: Tab into a block of tokens, arrows move token by token.
    page.mouse.move(0, 0)
    expect(card).to_be_hidden()
    page.focus("#turn-0 .answer .tokens")
    tokens = page.locator("#turn-0 .answer .tok")
    expect(facts.nth(0)).to_have_text(tokens.nth(0).get_attribute("data-id"))
    page.keyboard.press("ArrowRight")
    expect(tokens.nth(1)).to_be_focused()
    expect(facts.nth(0)).to_have_text(tokens.nth(1).get_attribute("data-id"))
    page.keyboard.press("Escape")
    expect(card).to_be_hidden()


def test_agent_page_fits_both_widths(logged_in, live_server, project, recorded):
    page = logged_in
    look(
        page,
        f"{live_server.url}/projects/{project.id}/agents/{recorded.agent_id}/",
        "agent",
        ready="#agent-live",
    )
    times = page.locator("#recent-interactions time")
    assert times.count() >= 1 and " UTC" in times.first.get_attribute("title")


def test_api_docs_render_with_the_network_cut_off(page, live_server):
    local = urlparse(live_server.url).netloc
    blocked = []

    def only_local(route):
        if urlparse(route.request.url).netloc == local:
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    page.route("**/*", only_local)
    look(page, f"{live_server.url}/api/v1/docs/", "docs", ready=".opblock")
    assert page.locator(".opblock").count() > 10  # every operation of the API
    assert blocked == []  # nothing was even asked of a CDN


def test_favicon_is_served(page, live_server):
    response = page.goto(f"{live_server.url}/favicon.ico")
    assert response.status == 200
    assert response.headers["content-type"].startswith("image/svg+xml")


def test_forms_align_labels_and_inputs_at_both_widths(logged_in, live_server, project):
    page = logged_in
    look(page, f"{live_server.url}/projects/{project.id}/runs/new/", "run-new", ready="form")
    look(page, f"{live_server.url}/projects/{project.id}/keys/", "keys", ready="#keys-panel")
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(f"{live_server.url}/projects/{project.id}/agents/")
    name, run = box(page, "#agents-panel [name=name]"), box(page, "#agents-panel [name=run]")
    assert name["x"] == run["x"] and name["width"] == run["width"]
    label = box(page, "#agents-panel label[for=id_name]")
    assert label["x"] + label["width"] <= name["x"]  # labels to the left of their inputs
    page.set_viewport_size({"width": 390, "height": 900})
    label, name = (
        box(page, "#agents-panel label[for=id_name]"),
        box(page, "#agents-panel [name=name]"),
    )
    assert label["y"] + label["height"] <= name["y"]  # on a phone: above them


def test_list_pages_fit_both_widths(
    logged_in, live_server, project, make_trained_run, make_dataset
):
    page = logged_in
    make_trained_run("gsm8k-grpo", with_eval=False, steps=3)
    make_dataset(project, name="gsm-mini")
    look(page, f"{live_server.url}/projects/", "projects", ready="#projects-panel")
    look(page, f"{live_server.url}/projects/{project.id}/runs/", "runs", ready="#runs-table")
    look(
        page,
        f"{live_server.url}/projects/{project.id}/datasets/",
        "datasets",
        ready="#datasets-panel",
    )
    page.goto(f"{live_server.url}/projects/{project.id}/runs/")
    for width in WIDTHS.values():  # every project tab in sight, none scrolled away
        page.set_viewport_size({"width": width, "height": 900})
        for tab in page.locator("nav.tabs a").all():
            edge = tab.bounding_box()
            assert edge["x"] >= 0 and edge["x"] + edge["width"] <= width, (tab.inner_text(), width)
    created = page.locator("#runs-table time").first
    assert created.inner_text() == "just now" and " UTC" in created.get_attribute("title")
