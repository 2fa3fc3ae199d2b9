"""The API docs in a real browser at 1,400 and 390 px: the agent gateway first, a visible way
back to the dashboard, and an agent endpoint's errors when it is opened.

Screenshots go to ``.steep/screenshots/apidocs-<width>.png`` (or ``$STEEP_SCREENSHOT_DIR``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("STEEP_SCREENSHOT_DIR") or ROOT / ".steep" / "screenshots")


@pytest.mark.parametrize("width", [1400, 390])
def test_api_docs_lead_with_the_gateway_and_link_to_the_dashboard(page, live_server, width):
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(f"{live_server.url}/api/v1/docs/")
    tags = page.locator(".opblock-tag")
    expect(tags.first).to_contain_text("Agent gateway")

    back = page.get_by_role("link", name="← Dashboard")
    expect(back).to_be_visible()
    link = back.bounding_box()
    assert link is not None and link["x"] >= 0 and link["x"] + link["width"] <= width
    # The schema's description links back too (rendered by Swagger UI from markdown).
    expect(page.locator(".info .description a", has_text="Back to the dashboard")).to_be_visible()

    start = page.locator(".opblock", has_text="/rl/start_session").first
    start.locator(".opblock-summary").click()
    responses = start.locator(".responses-table .response-col_status")
    expect(responses.filter(has_text="429")).to_have_count(1)
    expect(start.locator(".authorization__btn")).to_be_visible()  # the lock: it needs a key
    scroll_width = page.evaluate("document.scrollingElement.scrollWidth")
    assert scroll_width <= width, f"the docs overflow sideways at {width} px: {scroll_width}"
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"apidocs-{width}.png"), full_page=False)

    back.click()
    page.wait_for_load_state()
    assert "/api/v1/docs/" not in page.url
