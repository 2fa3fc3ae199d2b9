"""CSRF protects the dashboard's forms; the API-key, gateway and internal-API surfaces take
no cookies and stay exempt, so machine clients never need a CSRF token."""

from __future__ import annotations

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


@pytest.fixture
def strict() -> Client:
    return Client(enforce_csrf_checks=True)


def test_dashboard_login_without_a_csrf_token_is_403(strict):
    response = strict.post("/login/", {"username": "ada", "password": "correct-horse-42"})
    assert response.status_code == 403


def test_dashboard_form_of_a_logged_in_member_without_a_token_is_403(strict, owner):
    strict.force_login(owner)
    assert strict.post("/projects/", {"name": "sneaky"}).status_code == 403


def test_rest_api_with_a_project_key_needs_no_csrf_token(strict, api_key):
    response = strict.post(
        "/api/v1/agents/",
        {"name": "bot"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {api_key}",
    )
    assert response.status_code == 201, response.content


def test_gateway_needs_no_csrf_token(strict):
    # Refused for its body (400), not for CSRF (403): no database or key is involved.
    response = strict.post(
        "/agents/00000000-0000-0000-0000-000000000000/v1/rl/set_reward",
        {},
        content_type="application/json",
    )
    assert response.status_code == 400


def test_internal_api_needs_no_csrf_token(strict, project, make_run, set_status):
    from webapp.runs.jobs import job_secret_issue

    run = set_status(make_run(project), "running")
    secret = job_secret_issue(run=run)
    response = strict.post(
        f"/internal/v1/runs/{run.id}/events",
        {"kind": "note", "message": "hello"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    assert response.status_code == 200, response.content
