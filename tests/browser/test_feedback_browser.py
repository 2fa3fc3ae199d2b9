"""Human feedback in a real browser: a click on thumbs-up rewards the session and makes it
trainable; the review queue rates the selected session from the keyboard."""

from __future__ import annotations

import pytest

from webapp.gateway.models import Session
from webapp.rewards.services import rewards_tick

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

T = Session.Trajectory


@pytest.fixture
def waiting(project, make_run, make_agent, make_session):
    run = make_run(project, reward={"type": "human", "timeout_s": 3600})
    agent = make_agent(project, run=run)
    sessions = [
        make_session(
            agent,
            [{"messages": [{"role": "user", "content": f"2+{n}?"}], "answer": str(2 + n)}],
            trajectory=T.UNREWARDED,
        )
        for n in (1, 2)
    ]
    rewards_tick()
    return sessions


def test_a_click_on_thumbs_up_sets_the_reward_and_the_session_becomes_trainable(
    logged_in, live_server, project, waiting
):
    page = logged_in
    session = waiting[0]
    page.goto(f"{live_server.url}/projects/{project.id}/sessions/{session.id}/")
    assert "none yet" in page.locator("#session-live").inner_text()
    page.click("#session-feedback button.thumb.up")
    page.wait_for_selector("#reward-total")
    assert page.locator("#reward-total").inner_text() == "1.000"
    assert "trajectory ready" in page.locator("#session-live").inner_text()
    session.refresh_from_db()
    assert session.trajectory == T.READY
    assert session.interactions.get().reward == 1.0


def test_the_review_queue_rates_from_the_keyboard(logged_in, live_server, project, waiting):
    page = logged_in
    page.goto(f"{live_server.url}/projects/{project.id}/review/")
    page.wait_for_selector("tr.review-item:focus")  # the first waiting session is selected
    first = page.locator("tr.review-item:focus").get_attribute("data-session")
    page.keyboard.press("d")
    page.wait_for_selector("tr.review-done")
    rated = Session.objects.get(pk=first)
    assert rated.trajectory == T.READY and rated.interactions.get().reward == 0.0
    page.keyboard.press("u")
    page.wait_for_function("document.querySelectorAll('tr.review-done').length === 2")
    assert {s.trajectory for s in Session.objects.filter(pk__in=[w.pk for w in waiting])} == {
        T.READY
    }


def test_an_open_sessions_page_stops_refreshing_while_a_comment_is_written(
    logged_in, live_server, project, make_run, make_agent, make_session
):
    """An open session's page refreshes itself every 3 s; while a score/comment form is open it
    waits, so what is being typed is not swapped away, also when the form was opened while a
    refresh was on its way (its answer is then not swapped in). The page's clock is
    Playwright's, and that refresh is held by the test until the form is open: the refreshes
    are counted, not timed."""
    agent = make_agent(project, run=make_run(project))
    session = make_session(
        agent,
        [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}],
        status=Session.Status.OPEN,
    )
    page = logged_in
    page.clock.install()
    url = f"{live_server.url}/projects/{project.id}/sessions/{session.id}/"
    held = []  # the page's own refreshes (htmx), held until the test lets them through
    page.route(
        url,
        lambda route: (
            held.append(route) if route.request.headers.get("hx-request") else route.continue_()
        ),
    )
    page.goto(url)
    page.evaluate(
        "window.polls = 0; window.answered = 0;"
        " document.body.addEventListener('htmx:beforeRequest', () => window.polls++);"
        " document.body.addEventListener('htmx:afterRequest', () => window.answered++)"
    )
    page.clock.run_for(3500)
    page.wait_for_function("window.polls >= 1")  # it refreshes while nobody writes

    page.click("#session-feedback summary")  # the refresh is still on its way
    page.fill("#session-feedback input[name=comment]", "half right")
    assert len(held) == 1
    held.pop().continue_()
    page.wait_for_function("window.answered >= 1")
    polls = page.evaluate("window.polls")
    page.clock.run_for(10_000)
    assert page.evaluate("window.polls") == polls
    assert page.input_value("#session-feedback input[name=comment]") == "half right"

    page.click("#session-feedback details button[type=submit]")
    page.wait_for_function("!document.querySelector('#session-feedback details[open]')")
    session.refresh_from_db()
    assert session.feedback.get().comment == "half right"


def test_a_long_sessions_turn_is_rated_on_its_own_page(
    logged_in, live_server, project, make_run, make_agent, make_session, tmp_path
):
    """Issue 36: a 45-turn session shows twenty turns a page; rating a turn on the first page
    keeps the page it was rated on."""
    agent = make_agent(project, run=make_run(project))
    turns = [
        {"messages": [{"role": "user", "content": f"Question {n}?"}], "answer": f"Answer {n}."}
        for n in range(45)
    ]
    session = make_session(agent, turns, stored_as_added=True, trajectory=T.UNREWARDED)
    page = logged_in
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(f"{live_server.url}/projects/{project.id}/sessions/{session.id}/")
    assert page.locator("article.turn").count() == 5  # the latest page: turns 40-44
    page.click("nav.turn-pages >> text=0–19")
    page.wait_for_selector("#turn-0")
    assert page.locator("article.turn").count() == 20
    page.screenshot(path=str(tmp_path / "long-session.png"), full_page=False)
    page.click("#turn-5 button.thumb.up")
    page.wait_for_selector("#turn-5 .badge.reward")
    assert "reward 1.000" in page.locator("#turn-5").inner_text()
    assert page.locator("article.turn").count() == 20 and page.locator("#turn-0").count() == 1
    assert session.interactions.get(turn=5).reward == 1.0
