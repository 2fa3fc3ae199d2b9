"""People's feedback: ``POST /api/v1/sessions/<id>/feedback/`` and its refusals, the rule that
turns it into a reward, a human run's timeout, and the dashboard's feedback and review pages."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from webapp.accounts.services import api_key_create
from webapp.gateway.models import Session
from webapp.rewards.models import Feedback, RewardRequest
from webapp.rewards.selectors import reward_summary
from webapp.rewards.services import rewards_tick
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db

T = Session.Trajectory
QUESTION = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}]


@pytest.fixture
def human_run(project, make_run):
    return make_run(project, reward={"type": "human", "timeout_s": 3600})


@pytest.fixture
def waiting(human_run, make_agent, make_session):
    """An ended session of a human run, unrewarded, with its reward request open."""
    agent = make_agent(project=human_run.project, run=human_run)
    session = make_session(
        agent,
        [*QUESTION, {"messages": [{"role": "user", "content": "and 3+3?"}], "answer": "6"}],
        trajectory=T.UNREWARDED,
    )
    Session.objects.filter(pk=session.pk).update(ended_at=timezone.now())
    rewards_tick()
    return session


def _url(session) -> str:
    return f"/api/v1/sessions/{session.id}/feedback/"


def test_thumbs_up_rewards_the_sessions_last_turn_and_makes_it_trainable(api, waiting, human_run):
    response = api.post(_url(waiting), {"rating": "up", "comment": "right"}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["reward"] == 1.0 and body["reward_applied"] is True
    assert body["trajectory"] == "ready" and body["interaction"] is None
    turns = list(waiting.interactions.order_by("turn"))
    assert [t.reward for t in turns] == [None, 1.0]  # the outcome reward, on the last turn
    human_run.refresh_from_db()
    assert human_run.sessions_accepted == 1
    request = RewardRequest.objects.get(session=waiting)
    assert request.state == RewardRequest.State.SCORED and request.score == 1.0


def test_a_score_wins_over_the_rating_and_rewards_the_named_turn(api, waiting):
    first = waiting.interactions.get(turn=0)
    response = api.post(
        _url(waiting),
        {"rating": "down", "score": 0.75, "interaction_id": first.id},
        format="json",
    )
    assert response.status_code == 201
    assert response.json()["reward"] == 0.75 and response.json()["interaction"] == first.id
    first.refresh_from_db()
    assert first.reward == 0.75
    down = api.post(_url(waiting), {"rating": "down"}, format="json").json()
    assert down["reward"] == 0.0  # thumbs down alone: 0.0 on the last turn


def test_a_comment_alone_is_kept_and_rewards_nothing(api, waiting):
    body = api.post(_url(waiting), {"comment": "hmm"}, format="json").json()
    assert body["reward"] is None and body["reward_applied"] is False
    assert body["trajectory"] == "unrewarded"
    assert Feedback.objects.get(session=waiting).comment == "hmm"


def test_feedback_on_a_trained_session_is_kept_but_changes_no_reward(
    api, make_agent, make_session, project
):
    agent = make_agent(project)
    session = make_session(
        agent, [{**QUESTION[0], "reward": 0.2}], trajectory=Session.Trajectory.TRAINED
    )
    body = api.post(_url(session), {"rating": "up"}, format="json").json()
    assert body["reward_applied"] is False and body["trajectory"] == "trained"
    assert session.interactions.get().reward == 0.2


@pytest.mark.parametrize(
    "payload, field",
    [
        ({}, "non_field_errors"),
        ({"rating": "meh"}, "rating"),
        ({"score": 2}, "score"),
        ({"score": -0.1}, "score"),
        ({"score": "lots"}, "score"),
        ({"comment": 5, "rating": "up", "score": [1]}, "score"),
        ({"rating": "up", "interaction_id": "chatcmpl-not-this-sessions"}, "interaction_id"),
        ({"comment": "x" * 4001}, "comment"),
    ],
)
def test_bad_feedback_is_400_naming_the_field_and_stores_nothing(
    api, api_error, waiting, payload, field
):
    error = api_error(api.post(_url(waiting), payload, format="json"), 400)
    assert field in error["fields"], error
    assert not Feedback.objects.exists()
    waiting.refresh_from_db()
    assert waiting.trajectory == T.UNREWARDED


@pytest.mark.parametrize("body", ["{not json", "[1, 2]", '"up"'])
def test_a_body_that_is_not_a_json_object_is_400(api, api_error, waiting, body):
    api_error(api.generic("POST", _url(waiting), body, content_type="application/json"), 400)
    assert not Feedback.objects.exists()


def test_an_oversize_body_is_413(api, api_error, waiting, settings):
    settings.MAX_REQUEST_BYTES = 1024
    body = json.dumps({"comment": "x" * 2000})
    api_error(api.generic("POST", _url(waiting), body, content_type="application/json"), 413)
    assert not Feedback.objects.exists()


def test_another_projects_session_is_404(other_api, api_error, waiting):
    api_error(other_api.post(_url(waiting), {"rating": "up"}, format="json"), 404)
    assert not Feedback.objects.exists()


@pytest.mark.parametrize("session_id", ["6c5e0a7e-4e0b-4d36-9a43-3f3b1a1d2b11", "not-a-uuid"])
def test_an_unknown_session_is_404(api, api_error, session_id):
    url = f"/api/v1/sessions/{session_id}/feedback/"
    api_error(api.post(url, {"rating": "up"}, format="json"), 404)


def test_an_expired_key_is_401(project, waiting, api_error):
    from rest_framework.test import APIClient

    _, expired = api_key_create(project=project, expires_at=timezone.now() - timedelta(seconds=1))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {expired}")
    api_error(client.post(_url(waiting), {"rating": "up"}, format="json"), 401)
    assert not Feedback.objects.exists()


def test_the_feedback_endpoint_is_in_the_openapi_schema(anon_api):
    schema = anon_api.get("/api/v1/schema/", HTTP_ACCEPT="application/json").json()
    operation = schema["paths"]["/api/v1/sessions/{session_id}/feedback/"]["post"]
    assert "201" in operation["responses"]
    request = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert request.endswith("/FeedbackInput")


def test_a_human_run_drops_sessions_nobody_rated_in_time_and_counts_why(
    project, make_run, make_agent, make_session
):
    run = make_run(project, reward={"type": "human", "timeout_s": 60})
    agent = make_agent(project, run=run)
    late = make_session(agent, QUESTION, trajectory=T.UNREWARDED)
    fresh = make_session(agent, QUESTION, trajectory=T.UNREWARDED)
    Session.objects.filter(pk=late.pk).update(ended_at=timezone.now() - timedelta(minutes=5))
    Session.objects.filter(pk=fresh.pk).update(ended_at=timezone.now())

    counts = rewards_tick()

    assert counts["dropped"] == 1
    late.refresh_from_db()
    fresh.refresh_from_db()
    assert (late.trajectory, fresh.trajectory) == (T.DROPPED, T.UNREWARDED)
    assert late.drop_reason == "human_timeout"  # the ledger's dropped_by_reason says so too
    summary = reward_summary(run=run)
    assert (summary["dropped"], summary["pending"]) == (1, 1)
    assert summary["reasons"] == [
        {"state": "dropped", "reason": "no human feedback within 60 s of the session's end", "n": 1}
    ]
    run.refresh_from_db()
    assert run.sessions_accepted == 0  # a dropped session holds no slot


def test_the_human_timeout_setting_is_validated(api, api_error):
    payload = {"name": "r", "base_model": "tiny-llama", "mode": "online"}
    for reward, message in [
        ({"type": "human", "timeout_s": 0}, "timeout_s"),
        ({"type": "human", "timeout_s": "soon"}, "timeout_s"),
        ({"type": "human", "stars": 5}, "Unknown reward keys"),
    ]:
        error = api_error(
            api.post("/api/v1/runs/", payload | {"reward": reward}, format="json"), 400
        )
        assert message in " ".join(error["fields"]["reward"]), error
    assert not Run.objects.exists()


# --- The dashboard ---------------------------------------------------------------------------


def test_the_session_page_offers_feedback_and_an_htmx_post_rewards_it(
    member_client, project, waiting
):
    page = member_client.get(f"/projects/{project.id}/sessions/{waiting.id}/").content.decode()
    assert 'data-feedback="session"' in page and page.count("thumb up") == 3  # session + 2 turns
    response = member_client.post(
        f"/projects/{project.id}/sessions/{waiting.id}/feedback/",
        {"rating": "up", "interaction_id": "", "comment": "good"},
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 200
    fragment = response.content.decode()
    assert fragment.startswith('<div id="session-live"') and "“good”" in fragment
    assert 'id="reward-total">1.000' in fragment
    waiting.refresh_from_db()
    assert waiting.trajectory == T.READY


def test_the_feedback_form_without_javascript_redirects_back(member_client, project, waiting):
    url = f"/projects/{project.id}/sessions/{waiting.id}/"
    response = member_client.post(url + "feedback/", {"rating": "down"})
    assert response.status_code == 302 and response["Location"] == url


def test_an_outsider_cannot_give_feedback_on_the_dashboard(outsider_client, project, waiting):
    response = outsider_client.post(
        f"/projects/{project.id}/sessions/{waiting.id}/feedback/", {"rating": "up"}
    )
    assert response.status_code == 404
    assert not Feedback.objects.exists()


def test_the_review_queue_lists_waiting_sessions_and_is_empty_without_any(
    member_client, project, waiting, make_session
):
    url = f"/projects/{project.id}/review/"
    page = member_client.get(url).content.decode()
    assert f'data-session="{waiting.id}"' in page and "review.js" in page
    response = member_client.post(
        f"/projects/{project.id}/sessions/{waiting.id}/feedback/",
        {"rating": "up", "from": "review"},
        HTTP_HX_REQUEST="true",
    )
    assert 'class="review-done"' in response.content.decode()
    assert "ready" in response.content.decode()
    assert "Nothing to review" in member_client.get(url).content.decode()


def test_the_review_queue_pages(member_client, project, human_run, make_agent, make_session):
    agent = make_agent(project, run=human_run)
    for _ in range(27):
        make_session(agent, QUESTION, trajectory=T.UNREWARDED)
    rewards_tick()
    first = member_client.get(f"/projects/{project.id}/review/").content.decode()
    second = member_client.get(f"/projects/{project.id}/review/?page=2").content.decode()
    assert first.count('class="review-item"') == 25 and second.count('class="review-item"') == 2
    assert "page 1 of 2" in first and "?page=2" in first


def test_the_run_page_shows_what_rewards_are_owed(member_client, project, human_run, waiting):
    page = member_client.get(f"/projects/{project.id}/runs/{human_run.id}/").content.decode()
    assert 'id="run-rewards"' in page and 'id="rewards-pending">1<' in page
    assert "Open the review queue" in page


def test_the_rewards_panel_refreshes_itself_while_the_run_is_active(
    member_client, project, human_run, waiting, make_agent, make_session
):
    url = f"/projects/{project.id}/runs/{human_run.id}/"
    Run.objects.filter(pk=human_run.pk).update(status=Run.Status.RUNNING)
    page = member_client.get(url).content.decode()
    assert f'hx-get="{url}?panel=rewards"' in page
    # Another session ends unrewarded: the panel's next poll counts it, and is only the panel.
    agent = make_agent(project=project, run=human_run)
    session = make_session(agent, QUESTION, trajectory=T.UNREWARDED)
    Session.objects.filter(pk=session.pk).update(ended_at=timezone.now())
    rewards_tick()
    panel = member_client.get(f"{url}?panel=rewards", HTTP_HX_REQUEST="true").content.decode()
    assert panel.startswith('<section class="card" id="run-rewards"')
    assert 'id="rewards-pending">2<' in panel and 'id="run-status"' not in panel
    # A finished run's panel stands still.
    Run.objects.filter(pk=human_run.pk).update(status=Run.Status.COMPLETED)
    assert "?panel=rewards" not in member_client.get(url).content.decode()


def test_feedback_on_an_expired_unrewarded_session_is_kept_but_not_applied(
    api, make_agent, make_session, project
):
    session = make_session(
        make_agent(project), QUESTION, status=Session.Status.EXPIRED, trajectory=T.UNREWARDED
    )
    body = api.post(_url(session), {"rating": "up"}, format="json").json()
    assert body["reward_applied"] is False and body["trajectory"] == "unrewarded"
    assert session.interactions.get().reward is None


def test_a_sessions_feedback_is_listed_newest_first_and_only_to_its_project(
    api, other_api, api_error, waiting
):
    assert api.get(_url(waiting)).json()["count"] == 0  # empty before any
    api.post(_url(waiting), {"rating": "down"}, format="json")
    api.post(_url(waiting), {"score": 0.5, "comment": "half right"}, format="json")
    body = api.get(_url(waiting)).json()
    assert body["count"] == 2
    assert [(f["rating"], f["score"], f["reward"]) for f in body["results"]] == [
        ("", 0.5, 0.5),
        ("down", None, 0.0),
    ]
    api_error(other_api.get(_url(waiting)), 404)
