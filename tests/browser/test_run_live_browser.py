"""In a real browser: create a run from the form, start it, and watch the reward chart update live."""

from __future__ import annotations

import io
import json

import pytest

from rl_core.toy import TOY_REWARD, TOY_SETTINGS, toy_rows

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_run_started_from_the_dashboard_shows_its_reward_chart_updating(
    browser, stack, owner, project
):
    from webapp.datasets.services import dataset_create
    from webapp.runs.models import Run

    body = "".join(json.dumps(row) + "\n" for row in toy_rows(64)).encode()
    dataset = dataset_create(project=project, name="letters", file=io.BytesIO(body))

    from django.test import Client

    session = Client()
    session.force_login(
        owner
    )  # the live server shares the database, so this session is valid there
    context = browser.new_context()
    context.add_cookies(
        [{"name": "sessionid", "value": session.cookies["sessionid"].value, "url": stack.url}]
    )
    page = context.new_page()
    page.set_default_timeout(20000)
    try:
        page.goto(f"{stack.url}/projects/{project.id}/runs/new/")
        page.fill("input[name=name]", "watch me learn")
        page.select_option("select[name=mode]", "dataset")
        page.select_option("select[name=dataset]", str(dataset.id))
        page.fill("input[name=base_model]", str(stack.model_dir))
        page.fill("input[name=reward]", json.dumps(TOY_REWARD))
        page.click("#advanced > summary")  # the settings below are folded under Advanced
        for name in (
            "batch_size",
            "group_size",
            "max_new_tokens",
            "learning_rate",
            "max_staleness",
        ):
            page.fill(f"input[name={name}]", str(TOY_SETTINGS[name]))
        page.fill("input[name=max_steps]", "40")
        page.click("button:has-text('Create run')")
        page.wait_for_url("**/runs/*/")
        run = Run.objects.get(project=project, name="watch me learn")

        page.click("button:has-text('Start')")
        page.wait_for_selector('.chart[data-metric="rollout/reward"]', timeout=240000)
        page.wait_for_function(
            "Number(document.getElementById('run-live').dataset.lastStep) >= 3", timeout=240000
        )
        first = int(page.get_attribute("#run-live", "data-last-step"))
        page.wait_for_function(
            f"Number(document.getElementById('run-live').dataset.lastStep) > {first}",
            timeout=120000,
        )
        assert page.locator('[data-live="status"]').inner_text() == "running"
        assert page.locator('.chart[data-metric="rollout/reward"] canvas').count() == 1

        page.click("button:has-text('Stop')")
        run.refresh_from_db()
        assert run.status in ("stopping", "stopped")
        page.wait_for_function(  # (no status element while the page reloads after Stop)
            "document.querySelector('[data-live=\"status\"]')?.textContent === 'stopped'",
            timeout=180000,
        )
    except Exception as exc:  # what the run and the stack were doing when a wait ran out
        raise AssertionError(f"{exc}\n{run_state(project)}\n{stack.log_tail()}") from exc
    finally:
        context.close()


def run_state(project) -> str:
    from webapp.runs.models import Run

    lines = []
    for run in Run.objects.filter(project=project):
        events = [
            f"  {e.created_at:%H:%M:%S} {e.kind}: {e.message[:200]}" for e in run.events.all()
        ]
        lines += [
            f"run {run.name!r}: status={run.status} step={run.step} job={run.job_id!r} "
            f"queue_reason={run.queue_reason!r} error={run.error[:500]!r} "
            f"metrics={run.metrics.count()}",
            *events,
            f"job log tail:\n{run.job_log_tail[-3000:]}",
        ]
    return "\n".join(lines)
