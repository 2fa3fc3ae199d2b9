"""The internal API (``/internal/v1/runs/<id>/...``) answers only the run's current job secret:
never a project key, a session key, a previous attempt's secret or another run's. With
``INTERNAL_API_ALLOWED_CIDRS`` it also answers only callers from those networks."""

from __future__ import annotations

import pytest

from webapp.runs.jobs import job_secret_issue

pytestmark = pytest.mark.django_db

# One endpoint of each kind: a read, a report, a trajectory hand-off.
ENDPOINTS = [
    ("GET", "config", None),
    ("POST", "status", {"status": "running"}),
    ("POST", "claim", {"limit": 1}),
]


@pytest.fixture
def running(project, make_run, set_status):
    return set_status(make_run(project, batch_size=2), "running")


def call(client, run, method: str, name: str, body, token: str | None, **extra):
    url = f"/internal/v1/runs/{run.id}/{name}"
    if token is not None:
        extra["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    if method == "GET":
        return client.get(url, **extra)
    return client.post(url, body or {}, content_type="application/json", **extra)


def assert_refused(response, status: int = 401) -> None:
    assert response.status_code == status, response.content
    assert response.json()["error"]["code"] == "internal_api_error"


@pytest.mark.parametrize("method,name,body", ENDPOINTS)
def test_a_project_key_is_refused(client, running, api_key, method, name, body):
    job_secret_issue(run=running)
    assert_refused(call(client, running, method, name, body, api_key))


@pytest.mark.parametrize("method,name,body", ENDPOINTS)
def test_a_previous_attempts_secret_is_refused(client, running, method, name, body):
    previous = job_secret_issue(run=running)
    current = job_secret_issue(run=running)  # the run was launched again
    assert_refused(call(client, running, method, name, body, previous))
    assert call(client, running, "GET", "config", None, current).status_code == 200


def test_a_session_key_is_refused(client, running, project, make_agent, api_key):
    from webapp.accounts.keys import SESSION_KEY_PREFIX, generate_key
    from webapp.gateway.episodes import start
    from webapp.gateway.lane import in_transaction

    agent = make_agent(project, run=running)
    operation = start(
        token=api_key,
        agent_id=agent.pk,
        task_id="",
        metadata={},
        new_key=generate_key(SESSION_KEY_PREFIX),
    )
    session_key = in_transaction(operation)["api_key"]
    job_secret_issue(run=running)
    assert_refused(call(client, running, "GET", "config", None, session_key))


def test_it_validates_ownership_another_runs_current_secret_is_refused(
    client, running, other_project, make_run, set_status
):
    job_secret_issue(run=running)
    theirs = set_status(make_run(other_project, name="theirs"), "running")
    assert_refused(call(client, running, "GET", "config", None, job_secret_issue(run=theirs)))


def test_no_credentials_at_all_are_refused(client, running):
    job_secret_issue(run=running)
    assert_refused(call(client, running, "GET", "config", None, None))


def test_allowed_networks_restrict_callers_even_with_the_right_secret(client, running, settings):
    secret = job_secret_issue(run=running)
    settings.INTERNAL_API_ALLOWED_CIDRS = ["10.0.0.0/8", "fd00::/8"]
    outside = call(client, running, "GET", "config", None, secret, REMOTE_ADDR="192.168.1.5")
    assert_refused(outside, 403)
    for inside in ("10.1.2.3", "fd00::5"):
        response = call(client, running, "GET", "config", None, secret, REMOTE_ADDR=inside)
        assert response.status_code == 200, response.content


def test_no_allowed_networks_means_any(client, running, settings):
    secret = job_secret_issue(run=running)
    settings.INTERNAL_API_ALLOWED_CIDRS = []
    response = call(client, running, "GET", "config", None, secret, REMOTE_ADDR="203.0.113.9")
    assert response.status_code == 200
