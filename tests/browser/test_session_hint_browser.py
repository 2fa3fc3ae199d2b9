"""A session's hint and the per-token signal it produced, in a real browser (issue 38): the
hint is shown, each trained token is coloured by the sign and size of its signal, and hovering a
token tells its value."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from webapp.gateway.models import Session

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

HINT = "Answer with the digit only."


def test_the_session_page_shows_the_hint_and_colours_tokens_by_its_signal(
    logged_in, live_server, project, make_run, make_agent, make_session
):
    run = make_run(project, self_distill=True)
    session = make_session(
        make_agent(project, run=run),
        [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "It is 4"}],
    )
    tokens = session.interactions.get().outputs[0]["output_ids"]
    signal = [round(0.9 - 0.6 * i, 4) for i in range(len(tokens))]  # up first, then down
    Session.objects.filter(pk=session.pk).update(
        hint=HINT,
        hint_signal={"hint": HINT, "trajectories": [{"tokens": tokens, "signal": signal}]},
    )
    page = logged_in
    page.goto(f"{live_server.url}/projects/{project.id}/sessions/{session.id}/")
    panel = page.locator("#session-hint")
    expect(panel).to_contain_text(HINT)
    shown = panel.locator(".hint-signal .tok")
    expect(shown).to_have_count(len(tokens))
    assert "sigup" in shown.first.get_attribute("class")
    assert "sigdown" in shown.last.get_attribute("class")
    shown.last.hover()
    card = page.locator("#tok-card")
    expect(card).to_be_visible()
    expect(card).to_contain_text("hint signal")
    expect(card).to_contain_text(f"{signal[-1]:.4f}")
