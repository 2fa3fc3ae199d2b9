"""The dashboard in a real browser: log in, create a key, upload a dataset, create a run and an agent."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from webapp.accounts.models import APIKey
from webapp.agents.models import Agent
from webapp.datasets.models import Dataset
from webapp.runs.models import Run

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_logged_out_visitor_is_sent_to_the_login_page(page, live_server):
    page.goto(f"{live_server.url}/projects/")
    assert "/login/" in page.url
    assert page.locator("h1").inner_text() == "Log in"


def test_a_new_key_is_shown_once_and_then_only_its_prefix(logged_in, live_server, project):
    page = logged_in
    page.click(f"text={project.name}")
    page.click("nav.tabs >> text=API keys")
    # The click navigates; expect waits for the new page (content() mid-navigation is empty).
    expect(page.locator("body")).to_contain_text("No API keys yet")
    page.fill("#keys-panel input[name=name]", "laptop")
    page.click("#keys-panel button:has-text('Create key')")
    shown = page.locator("#new-key-value").inner_text()
    assert shown.startswith("sk-steep-")
    key = APIKey.objects.get(project=project)
    assert key.prefix == shown[: len(key.prefix)] and shown not in (key.hashed, key.prefix)
    page.reload()
    assert page.locator("#new-key-value").count() == 0
    assert shown not in page.content()
    assert key.prefix in page.content()


def test_a_bad_dataset_shows_line_numbered_errors_inline_and_stores_nothing(
    logged_in, live_server, project, tmp_path
):
    page = logged_in
    page.goto(f"{live_server.url}/projects/{project.id}/datasets/")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"nope": 1}\nnot json\n')
    page.fill("#datasets-panel input[name=name]", "broken")
    page.set_input_files("#datasets-panel input[name=file]", str(bad))
    page.click("#datasets-panel button:has-text('Upload')")
    page.wait_for_selector("#upload-errors")
    text = page.locator("#datasets-panel").inner_text()
    assert "line 2" in text and "line 3" in text
    assert not Dataset.objects.filter(project=project).exists()

    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "Say a.", "answer": "a"}\n{"prompt": "Say b.", "answer": "b"}\n')
    page.fill("#datasets-panel input[name=name]", "letters")
    page.set_input_files("#datasets-panel input[name=file]", str(good))
    page.click("#datasets-panel button:has-text('Upload')")
    page.wait_for_url("**/datasets/*/")
    expect(page.locator("body")).to_contain_text("2 rows")


def test_a_run_created_from_the_form_and_an_agent_with_its_base_url(
    logged_in, live_server, project
):
    page = logged_in
    page.goto(f"{live_server.url}/projects/{project.id}/runs/new/")
    page.fill("input[name=name]", "first run")
    page.select_option("select[name=mode]", "online")
    page.fill("input[name=base_model]", "/models/tiny")
    page.click("#advanced > summary")  # max_staleness is folded under Advanced
    page.fill("input[name=max_staleness]", "-1")
    page.click("button:has-text('Create run')")
    expect(page.locator("body")).to_contain_text("max_staleness must be at least 0")
    assert not Run.objects.filter(project=project).exists()
    page.fill("input[name=max_staleness]", "2")
    page.click("button:has-text('Create run')")
    # A directory the instance does not offer as a model: said where models may come from.
    expect(page.locator("body")).to_contain_text("is not a model directory this instance offers")
    assert "STEEP_MODEL_ROOTS" in page.content()
    assert not Run.objects.filter(project=project).exists()
    page.fill("input[name=base_model]", "tiny-llama")  # one of the tests' model directories
    page.click("button:has-text('Create run')")
    page.wait_for_url("**/runs/*/")
    run = Run.objects.get(project=project)
    assert run.config["max_staleness"] == 2 and run.status == "draft"

    page.goto(f"{live_server.url}/projects/{project.id}/agents/")
    page.fill("#agents-panel input[name=name]", "helper bot")
    page.select_option("#agents-panel select[name=run]", str(run.id))
    page.click("#agents-panel button:has-text('Create agent')")
    page.wait_for_url("**/agents/*/")
    agent = Agent.objects.get(project=project)
    assert page.locator("#base-url").inner_text() == agent.base_url
    assert f'BASE_URL = "{agent.base_url}"' in page.locator("#snippet").inner_text()
