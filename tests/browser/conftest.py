"""A real headless Chromium (Debian's package) driven by Playwright against a live server."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.e2e.conftest import stack  # noqa: F401  (the live web + worker + Ray stack)
from tests.web.conftest import (  # noqa: F401  (recorded sessions, written through the ORM)
    chat_tokenizer,
    make_session,
    tokenizer_dir,
)

CHROMIUM = os.environ.get("STEEP_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")


@pytest.fixture(scope="module")
def browser(django_db_setup):  # the test database exists before Playwright starts its loop
    # Playwright's sync API keeps an event loop running in the test thread until it
    # stops, which trips Django's async-safety check on the test's own ORM calls; both
    # live only as long as this module's tests, so later test modules are unaffected.
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="steep-chromium-")
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            yield browser
        finally:
            browser.close()
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser):
    context = browser.new_context()
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.set_default_timeout(15000)
    yield page
    context.close()


@pytest.fixture
def logged_in(page, live_server, owner, project):
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", owner.username)
    page.fill("input[name=password]", "correct-horse-42")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/projects/")
    return page
