"""The run page of a multi-agent run: a Roles section with each role's charts in a column of
its own, side by side on a desktop (1400 px) and stacked on a phone (390 px), each column led by
the role's reward; the header and the agents list name the roles. Screenshots:
``.steep/screenshots/run-roles-<width>.png``."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from tests.browser.fit import assert_fits
from tests.browser.test_console_layout import SHOTS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ROLES = ["speaker", "listener"]
PER_ROLE = ["reward", "num_trajectories", "staleness_max", "ppo/approx_kl"]


def _metrics(step: int) -> dict[str, float]:
    w = math.sin(step * 1.1)
    values = {"step": float(step), "rollout/reward": 0.5 + 0.1 * w, "ppo/approx_kl": 0.01 * w}
    for i, role in enumerate(ROLES):
        values |= {
            f"roles/{role}/reward": 0.3 * i + step / 40 + 0.05 * w,
            f"roles/{role}/num_trajectories": 8 + i + 2 * w,
            f"roles/{role}/staleness_max": float((step + i) % 3),
            f"roles/{role}/ppo/approx_kl": 0.002 * (i + 1) + 0.001 * w,
        }
    return values


@pytest.fixture
def roles_run(project, make_run, make_agent):
    from django.utils import timezone

    from webapp.agents.services import agent_create
    from webapp.runs.models import MetricPoint, Run

    run = make_run(project, name="referential-game", lora_rank=8, roles=ROLES)
    start = timezone.now() - timedelta(seconds=5 * 30)
    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, step=s, name=n, value=v, created_at=start + timedelta(seconds=5 * s))
        for s in range(1, 31)
        for n, v in _metrics(s).items()
    )
    Run.objects.filter(pk=run.pk).update(status="running", step=30, weight_version=30)
    agent_create(project=project, name="describer", run=run, role="speaker")
    agent_create(project=project, name="guesser", run=run, role="listener")
    run.refresh_from_db()
    return run


def _column_boxes(page) -> dict[str, dict]:
    return {
        role: page.locator(f'.role-column[data-role="{role}"]').bounding_box() for role in ROLES
    }


def test_each_roles_reward_chart_is_drawn_side_by_side(logged_in, live_server, roles_run):
    page = logged_in
    url = f"{live_server.url}/projects/{roles_run.project_id}/runs/{roles_run.id}/"
    SHOTS.mkdir(parents=True, exist_ok=True)

    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(url)
    page.wait_for_selector("#run-live[data-ready='1']")
    for role in ROLES:
        page.wait_for_selector(f'#role-charts .chart[data-metric="roles/{role}/reward"] canvas')
        column = page.locator(f'.role-column[data-role="{role}"] .chart')
        assert column.evaluate_all("cs => cs.map(c => c.dataset.metric)") == [
            f"roles/{role}/{name}" for name in sorted(PER_ROLE, key=lambda n: (n != "reward", n))
        ]
    assert page.locator(".metric-group [data-metric^='roles/']").count() == 0
    speaker, listener = (
        page.locator(f'.chart[data-metric="roles/{role}/reward"]').bounding_box() for role in ROLES
    )
    assert (
        abs(speaker["y"] - listener["y"]) < 2 and listener["x"] >= speaker["x"] + speaker["width"]
    )
    assert page.locator("#run-roles .role-badge").all_inner_texts() == ROLES
    agents = page.locator("#fold-agents li").all_inner_texts()
    assert any("describer" in a and "speaker" in a for a in agents)
    assert any("guesser" in a and "listener" in a for a in agents)
    page.screenshot(path=str(SHOTS / "run-roles-1400.png"), full_page=True)
    assert_fits(page)

    page.set_viewport_size({"width": 390, "height": 900})
    page.goto(url)
    page.wait_for_selector("#run-live[data-ready='1']")
    boxes = _column_boxes(page)
    assert boxes["listener"]["y"] >= boxes["speaker"]["y"] + boxes["speaker"]["height"]
    assert page.evaluate("document.scrollingElement.scrollWidth") <= 390
    page.screenshot(path=str(SHOTS / "run-roles-390.png"), full_page=True)
    assert_fits(page)


def test_the_recent_sessions_filter_by_role(logged_in, live_server, roles_run):
    from webapp.agents.models import Agent
    from webapp.gateway.models import Interaction, Session

    page = logged_in
    ids = {}
    for role in ROLES:
        agent = Agent.objects.get(run=roles_run, role=role)
        session = Session.objects.create(project=roles_run.project, agent=agent, run=roles_run)
        Interaction.objects.create(
            id=f"chatcmpl-{session.id.hex[:12]}",
            session=session,
            turn=0,
            request_hash="0" * 64,
            messages=[{"role": "user", "content": "A letter?"}],
            input_ids=[1, 2],
            outputs=[{"output_ids": [3], "logprobs": [-0.1], "versions": [0]}],
            response={},
            role=role,
        )
        ids[role] = str(session.id)[:8]
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(f"{live_server.url}/projects/{roles_run.project_id}/runs/{roles_run.id}/")
    rows = page.locator("#run-sessions table.sessions tbody tr")
    assert sorted(rows.locator("td code").all_inner_texts()) == sorted(ids.values())
    page.locator("#run-sessions nav.filters a", has_text="listener").click()
    page.wait_for_url("**?role=listener*")
    assert rows.locator("td code").all_inner_texts() == [ids["listener"]]
    active = page.locator("#run-sessions nav.filters a.active")
    assert active.inner_text() == "listener"
    page.locator("#fold-sessions").screenshot(path=str(SHOTS / "run-sessions-by-role-1400.png"))
    assert_fits(page)
    page.set_viewport_size({"width": 390, "height": 900})
    page.reload()
    page.locator("#fold-sessions").evaluate("d => { d.open = true }")  # folded on a phone
    assert rows.locator("td code").all_inner_texts() == [ids["listener"]]
    page.locator("#fold-sessions").screenshot(path=str(SHOTS / "run-sessions-by-role-390.png"))
    assert_fits(page)
