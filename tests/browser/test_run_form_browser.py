"""The new-run form in a real browser: presets fill it in place, Advanced folds the rest, it fits.

Screenshots go to ``$STEEP_SCREENSHOT_DIR`` (default ``.steep/screenshots``) as
``run-form-<what>-<width>.png``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from playwright.sync_api import expect

from rl_core.toy import DEMO_SETTINGS
from tests.browser.fit import assert_fits
from webapp.runs.models import Run

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("STEEP_SCREENSHOT_DIR") or ROOT / ".steep" / "screenshots")
WIDTHS = (1400, 390)


def shoot(page, what: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    width = page.viewport_size["width"]
    page.screenshot(path=str(SHOTS / f"run-form-{what}-{width}.png"), full_page=True)


def new_run_url(live_server, project) -> str:
    return f"{live_server.url}/projects/{project.id}/runs/new/"


def test_the_demo_preset_fills_the_form_in_place_and_creates_the_demos_run(
    logged_in, live_server, project, make_dataset, settings
):
    dataset = make_dataset(project, name="say-the-letter")
    page = logged_in
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(new_run_url(live_server, project))
    page.fill("input[name=name]", "letters")
    batch_size = page.locator("input[name=batch_size]")
    expect(batch_size).to_be_hidden()  # folded under Advanced

    page.click("a[data-preset=demo]")
    assert page.url.endswith("?preset=demo")
    expect(page.locator("input[name=name]")).to_have_value("letters")  # filled in place
    expect(page.locator("a[data-preset=demo]")).to_have_attribute("aria-current", "true")
    expect(page.locator("select[name=mode]")).to_have_value("dataset")
    expect(page.locator("select[name=dataset]")).to_have_value(str(dataset.id))
    expect(page.locator("input[name=base_model]")).to_have_value(settings.STEEP_DEMO_MODEL)
    reward = page.locator("input[name=reward]").input_value()
    assert json.loads(reward) == DEMO_SETTINGS["reward"]
    expect(page.locator("#preset-description")).to_contain_text("say the letter")

    page.click("#advanced > summary")
    expect(batch_size).to_be_visible()
    expect(batch_size).to_have_value("64")
    expect(page.locator("input[name=learning_rate]")).to_have_value("0.0003")
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        assert_fits(page)
        shoot(page, "demo-advanced")

    page.set_viewport_size({"width": 1400, "height": 900})
    page.click("button:has-text('Create run')")
    page.wait_for_url(f"**/projects/{project.id}/runs/*/")
    run = Run.objects.get(project=project)
    assert page.url.endswith(f"/runs/{run.id}/")
    expect(page.locator("h2").first).to_have_text("letters")
    expect(page.locator("#run-status [data-live=status]")).to_have_text("draft")
    assert run.dataset == dataset
    assert {name: run.config[name] for name in DEMO_SETTINGS} == DEMO_SETTINGS


def test_the_pool_preset_switches_to_online_and_shows_the_pool_up_front(
    logged_in, live_server, project
):
    from webapp.pools.services import pool_create

    pool_create(name="demo", base_model="tiny-llama", backend="torch", start=False)
    page = logged_in
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(new_run_url(live_server, project))
        expect(page.locator("select[name=dataset]")).to_be_visible()  # dataset mode
        expect(page.locator("#essentials [data-mode=online]")).to_be_hidden()
        assert_fits(page)
        shoot(page, "new")

    page.set_viewport_size({"width": 1400, "height": 900})
    page.click("a[data-preset=lora-pool]")
    expect(page.locator("select[name=mode]")).to_have_value("online")
    # Online: the dataset gives way to the note on agents; the pool and rank are essentials.
    expect(page.locator("select[name=dataset]")).to_be_hidden()
    expect(page.locator("#essentials [data-mode=online]")).to_contain_text("base_url")
    expect(page.locator("#essentials select[name=inference_pool]")).to_have_value("demo")
    expect(page.locator("#essentials input[name=lora_rank]")).to_have_value("8")
    expect(page.locator("input[name=reward]")).to_have_value("")
    page.set_viewport_size({"width": 390, "height": 900})
    assert_fits(page)
    shoot(page, "lora-pool")

    page.fill("input[name=name]", "adapter")
    page.click("button:has-text('Create run')")
    page.wait_for_url(f"**/projects/{project.id}/runs/*/")
    config = Run.objects.get(project=project, name="adapter").config
    assert (config["mode"], config["inference_pool"], config["lora_rank"]) == ("online", "demo", 8)


def test_an_advanced_error_comes_back_with_advanced_open_and_the_error_in_view(
    logged_in, live_server, project
):
    page = logged_in
    page.set_viewport_size({"width": 390, "height": 900})
    page.goto(new_run_url(live_server, project))
    page.fill("input[name=name]", "bad")
    page.select_option("select[name=mode]", "online")
    page.fill("input[name=base_model]", "tiny-llama")
    page.fill("input[name=reward]", "")
    page.click("#advanced > summary")
    page.fill("input[name=max_staleness]", "-1")
    page.click("button:has-text('Create run')")
    expect(page.locator("#advanced")).to_have_attribute("open", "")
    error = page.locator("#advanced .has-error .errors")
    expect(error).to_contain_text("max_staleness must be at least 0")
    expect(error).to_be_visible()
    expect(page.locator("input[name=max_staleness]")).to_have_value("-1")
    assert_fits(page)
    shoot(page, "error")
    assert not Run.objects.filter(project=project).exists()
