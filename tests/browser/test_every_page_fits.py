"""Every page of the console at a desktop (1,400 px) and a phone (390 px) width: no table's last
visible column and no form control ends outside the viewport or a box that clips it
(``tests/browser/fit.py``), and every list's status column is in sight on a phone.

The pages show a project with something in every list: a dataset run 60 steps in (its metrics,
checkpoints, an eval), an online run with an agent and recorded sessions, a run whose sessions
wait for review, API keys, a pool with a run attached, and long names and paths where people
write them. Screenshots go to ``.steep/screenshots/fit-<page>-<width>.png`` (or
``$STEEP_SCREENSHOT_DIR``).
"""

from __future__ import annotations

import re
from datetime import timedelta
from types import SimpleNamespace

import pytest
from playwright.sync_api import expect

from tests.browser.fit import assert_fits, offenders
from tests.browser.test_console_layout import SHOTS
from tests.browser.test_run_page_browser import metrics_at

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTHS = (1400, 390)
MODEL = "/srv/steep/data/models/Qwen2.5-0.5B-Instruct"  # an absolute path, as ./steep up writes
USER = {"role": "user"}


@pytest.fixture
def world(owner, project, make_run, make_dataset, make_agent, make_session, tokenizer_dir):
    """One project with something in every list (the owner is staff, to see the pools)."""
    from django.utils import timezone

    from webapp.accounts.services import api_key_create
    from webapp.evals.models import Eval, EvalExample
    from webapp.gateway.models import Session
    from webapp.pools.services import pool_create, pool_server_register, pool_transition
    from webapp.rewards.services import rewards_tick
    from webapp.runs.models import Checkpoint, MetricPoint, Run

    type(owner).objects.filter(pk=owner.pk).update(is_staff=True)
    dataset = make_dataset(
        project,
        name="gsm8k-train-with-a-long-descriptive-name",
        rows=[{"prompt": f"What is {n} + {n}?", "answer": str(2 * n)} for n in range(40)],
    )
    trained = make_run(
        project,
        name="gsm8k-grpo-qwen2.5-0.5b-lr1e-6-kl0.01",
        dataset=dataset,
        max_steps=200,
        eval_fraction=0.25,
    )
    start = timezone.now() - timedelta(minutes=6)
    MetricPoint.objects.bulk_create(
        MetricPoint(
            run=trained,
            step=step,
            name=name,
            value=value,
            created_at=start + timedelta(seconds=6 * step),
        )
        for step in range(1, 61)
        for name, value in metrics_at(step).items()
    )
    for step in (20, 40, 60):
        Checkpoint.objects.create(
            run=trained,
            version=step,
            step=step,
            path=f"/srv/steep/data/runs/{trained.id}/checkpoints/step-{step}",
            size_bytes=987_654_321,
            export_status="done" if step == 20 else "",
            export_path=f"/srv/steep/data/exports/{trained.id}/step-20" if step == 20 else "",
        )
    Run.objects.filter(pk=trained.pk).update(
        status="running", step=60, weight_version=60, started_at=start, base_model=MODEL
    )
    evaluation = Eval.objects.create(
        project=project,
        run=trained,
        dataset=dataset,
        k=4,
        pass_threshold=1.0,
        max_new_tokens=256,
        temperature=1.0,
        status="done",
        examples=10,
        mean_reward=0.55,
        mean_reward_low=0.4,
        mean_reward_high=0.7,
        pass_at_k=0.8,
        pass_at_k_low=0.6,
        pass_at_k_high=0.9,
    )
    EvalExample.objects.bulk_create(
        EvalExample(
            eval=evaluation,
            index=i,
            messages=[USER | {"content": f"What is {i} + {i}? Think step by step. " * 3}],
            answer=str(2 * i),
            completions=[f"{i} plus {i} makes {2 * i}, so the answer is {2 * i}."] * 4,
            rewards=[1.0, 0.0, 1.0, 1.0],
            mean_reward=0.75,
            pass_at_k=1.0,
        )
        for i in range(10)
    )

    online = make_run(project, name="online-agents", base_model=str(tokenizer_dir))
    Run.objects.filter(pk=online.pk).update(status="running", step=14, weight_version=14)
    agent = make_agent(project, name="support-bot-with-tools", run=online)
    session = make_session(
        agent,
        [
            {
                "messages": [USER | {"content": "What is 2 + 2?"}],
                "answer": "It is 4.",
                "versions": 3,
                "reward": 0.5,
            },
            {
                "messages": [USER | {"content": "And times 3?"}],
                "answer": "That makes 12.",
                "versions": (3, 4, 8),
                "reward": 1.0,
            },
        ],
        task_id="arith-0001-with-a-long-task-id",
        admitted_version=3,
    )
    make_session(agent, [{"messages": [USER | {"content": "Name a prime."}], "answer": "7"}])

    rated = make_run(project, name="rated-by-people", reward={"type": "human", "timeout_s": 3600})
    helper = make_agent(project, name="helper", run=rated)
    for n in range(3):
        make_session(
            helper,
            [{"messages": [USER | {"content": f"2+{n}?"}], "answer": str(2 + n)}],
            trajectory=Session.Trajectory.UNREWARDED,
            task_id=f"sum-{n:04d}",
        )
    rewards_tick()

    for name in ("laptop", "ci"):
        api_key_create(project=project, name=name, user=owner)

    pool = pool_create(name="shared", base_model="tiny-llama", start=False)
    pool = pool_transition(pool=pool, to="starting")
    pool_server_register(pool=pool, url="http://127.0.0.1:9", backend="torch")
    lora = make_run(project, name="lora-on-the-pool", lora_rank=8, inference_pool="shared")
    Run.objects.filter(pk=lora.pk).update(status="running", weight_version=3)
    return SimpleNamespace(
        project=project, dataset=dataset, run=trained, eval=evaluation, agent=agent, session=session
    )


def project_page(path: str):
    return lambda w: f"/projects/{w.project.id}/{path.format(w=w)}"


# name: (path for the world, what shows once the page is ready, logged in)
PAGES = {
    "login": (lambda w: "/login/", "form button[type=submit]", False),
    "signup": (lambda w: "/signup/", "form button[type=submit]", False),
    "projects": (lambda w: "/projects/", "#projects-panel", True),
    "keys": (project_page("keys/"), "#keys-panel table", True),
    "datasets": (project_page("datasets/"), "#datasets-panel table", True),
    "dataset": (project_page("datasets/{w.dataset.id}/"), "pre.preview", True),
    "agents": (project_page("agents/"), "#agents-panel table", True),
    "agent": (project_page("agents/{w.agent.id}/"), "#agent-live", True),
    "runs": (project_page("runs/"), "#runs-table table", True),
    "run-new": (project_page("runs/new/"), "form button[type=submit]", True),
    "run": (project_page("runs/{w.run.id}/"), "#run-live[data-ready='1'] canvas", True),
    "session": (project_page("sessions/{w.session.id}/"), "#version-legend", True),
    "review": (project_page("review/"), "#review-table", True),
    "eval": (project_page("runs/{w.run.id}/evals/{w.eval.id}/"), "#eval-examples", True),
    "pools": (lambda w: "/pools/", "#pools-table table", True),
    "api-docs": (lambda w: "/api/v1/docs/", ".opblock", False),
}


@pytest.mark.parametrize("name", PAGES)
def test_every_page_fits_a_desktop_and_a_phone(request, page, live_server, world, name):
    path, ready, login = PAGES[name]
    if login:
        request.getfixturevalue("logged_in")
    url = live_server.url + path(world)
    SHOTS.mkdir(parents=True, exist_ok=True)
    found = []
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(url)
        page.wait_for_selector(ready)
        page.screenshot(path=str(SHOTS / f"fit-{name}-{width}.png"), full_page=True)
        found += [f"{width} px: {o}" for o in offenders(page)]
        scroll_width = page.evaluate("document.scrollingElement.scrollWidth")
        if scroll_width > width:
            found.append(f"{width} px: the page scrolls sideways ({scroll_width} px wide)")
        # What is folded (Advanced settings, metric groups, checkpoints) fits once opened too.
        if page.locator("details:not([open])").count():
            page.locator("details").evaluate_all("ds => ds.forEach(d => { d.open = true; })")
            page.screenshot(path=str(SHOTS / f"fit-{name}-{width}-open.png"), full_page=True)
            found += [f"{width} px, unfolded: {o}" for o in offenders(page)]
        for status in page.locator("table th").filter(has_text=re.compile(r"^\s*Status\s*$")).all():
            expect(status).to_be_visible()  # on a phone too: a list's status stays in sight
    assert not found, f"{name}: {len(found)} element(s) do not fit:\n" + "\n".join(found)


TABLE = """
<style>body {{ margin: 0 }} td {{ padding: 4px 12px; white-space: nowrap }}
  @media (max-width: 500px) {{ .opt {{ display: none }} }}</style>
<div style="width: {box}px; overflow-x: auto">
  <table><tr><td>name</td><td>running</td>
    <td class="opt">a-long-secondary-value-that-is-hidden-on-a-phone</td>
    <td>{last}</td></tr></table>
</div>
"""


def test_fit_catches_a_last_column_cut_off_by_a_scrolling_box(page):
    page.set_viewport_size({"width": 1400, "height": 600})
    page.set_content(TABLE.format(box=1200, last="0.688"))
    assert offenders(page) == []
    assert_fits(page)
    page.set_content(TABLE.format(box=300, last="0.688"))  # fits the screen, not its box
    (cut,) = offenders(page)
    assert cut.startswith('td "0.688" in a table') and "outside 0..300" in cut
    with pytest.raises(AssertionError, match="1 element"):
        assert_fits(page)


def test_fit_checks_the_last_column_a_phone_shows(page):
    page.set_viewport_size({"width": 390, "height": 600})
    page.set_content(TABLE.format(box=390, last="0.688"))  # the wide column steps aside
    assert offenders(page) == []
    page.set_content(TABLE.format(box=390, last="step 14 " * 12))
    (cut,) = offenders(page)
    assert cut.startswith('td "step 14 step 14') and "outside 0..390" in cut


def test_fit_passes_over_what_a_closed_details_holds(page):
    page.set_viewport_size({"width": 390, "height": 600})
    folded = TABLE.format(box=390, last="step 14 " * 12)
    page.set_content(f"<details><summary>Checkpoints</summary>{folded}</details>")
    assert offenders(page) == []  # laid out (content-visibility: hidden), yet not in sight
    page.locator("details").evaluate("d => { d.open = true; }")
    assert len(offenders(page)) == 1
