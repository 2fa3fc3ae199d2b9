"""One URL, two answers: htmx requests get the fragment they target, plain requests the page."""

from __future__ import annotations

import json
import re

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db

HTMX = {"HX-Request": "true"}


@pytest.fixture
def run(project, make_run):
    return make_run(project, name="frag-run")


@pytest.mark.parametrize(
    "name,fragment_id",
    [
        ("runs", "runs-table"),
        ("run", "run-status"),
        ("agents", "agents-panel"),
        ("datasets", "datasets-panel"),
        ("keys", "keys-panel"),
        ("projects", "projects-panel"),
    ],
)
def test_htmx_gets_the_fragment_and_a_plain_request_the_page(
    member_client, project, run, name, fragment_id
):
    args = {"projects": [], "run": [project.id, run.id]}.get(name, [project.id])
    url = reverse(f"dashboard:{name}", args=args)

    fragment = member_client.get(url, headers=HTMX)
    assert fragment.status_code == 200
    html = fragment.content.decode()
    assert "<html" not in html and "<body" not in html
    assert html.lstrip().startswith(f'<div id="{fragment_id}"')

    page = member_client.get(url)
    assert page.status_code == 200
    full = page.content.decode()
    assert "<html" in full and f'id="{fragment_id}"' in full


def test_boosted_htmx_requests_get_the_whole_page(member_client, project):
    url = reverse("dashboard:runs", args=[project.id])
    response = member_client.get(url, headers=HTMX | {"HX-Boosted": "true"})
    assert "<html" in response.content.decode()


def test_active_runs_poll_and_finished_runs_do_not(member_client, project, run, set_status):
    url = reverse("dashboard:run", args=[project.id, run.id])
    assert "hx-trigger" not in member_client.get(url, headers=HTMX).content.decode()
    set_status(run, "running")
    polled = member_client.get(url, headers=HTMX).content.decode()
    assert f'hx-get="{url}"' in polled and 'hx-trigger="every 3s"' in polled


def test_htmx_key_creation_returns_the_panel_with_the_new_key(member_client, project):
    response = member_client.post(
        reverse("dashboard:keys", args=[project.id]), {"name": "k"}, headers=HTMX
    )
    html = response.content.decode()
    assert "<html" not in html and 'id="new-key-value">sk-steep-' in html


def test_htmx_key_revoke_returns_the_panel(member_client, project):
    from webapp.accounts.services import api_key_create

    key, _ = api_key_create(project=project, name="old")
    url = reverse("dashboard:key-revoke", args=[project.id, key.id])
    response = member_client.post(url, headers=HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="keys-panel"') and "revoked" in html


def test_every_hx_get_link_keeps_a_plain_href_or_form(member_client, project, run):
    """Pages must work without JavaScript: polling targets are real URLs that serve the page."""
    html = member_client.get(reverse("dashboard:runs", args=[project.id])).content.decode()
    for url in re.findall(r'hx-get="([^"]+)"', html):
        assert member_client.get(url).status_code == 200


def test_htmx_swaps_form_errors_instead_of_dropping_them(member_client, project):
    """htmx 2 ignores 4xx bodies unless configured; the upload form answers 400 with its errors.

    Applies htmx's rule (the first ``responseHandling`` entry whose ``code`` regex matches
    the status decides) to the config that base.html ships.
    """
    html = member_client.get(reverse("dashboard:datasets", args=[project.id])).content.decode()
    config = json.loads(re.search(r"<meta name=\"htmx-config\" content='([^']+)'>", html)[1])

    def swaps(status: int) -> bool:
        rule = next(r for r in config["responseHandling"] if re.search(r["code"], str(status)))
        return rule["swap"]

    assert swaps(200) and swaps(400) and swaps(413)
    assert not swaps(204) and not swaps(404) and not swaps(500)
