"""LLM-judge rewards against a stub OpenAI-compatible judge (a real HTTP server the test
starts): a dataset run's episodes are judged and become trainable; a malformed verdict is asked
again once, then the session is unscored with the reason; a cached verdict costs no call; an
outage delays scoring and loses nothing."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from webapp.gateway.models import Interaction, Session
from webapp.rewards.models import JudgeCall, RewardRequest
from webapp.rewards.selectors import reward_summary
from webapp.rewards.services import judge_due, reward_requests_open, rewards_tick
from webapp.runs.jobs import job_submit_episodes
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db

T = Session.Trajectory


def _episode(answer: str, group: str) -> dict:
    return {
        "input_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
        "versions": [0, 0],
        "reward": None,
        "finish_reason": "stop",
        "text": answer,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "group_id": group,
        "task_id": "q1",
    }


@pytest.fixture
def judge_run(project, make_dataset, make_run, judge_spec):
    return make_run(project, dataset=make_dataset(project), reward=judge_spec, group_size=2)


def _rewards(run) -> dict[str, float | None]:
    return {
        i.response["choices"][0]["message"]["content"]: i.reward
        for i in Interaction.objects.filter(session__run=run)
    }


def test_a_judge_scores_a_dataset_runs_episodes_and_they_become_trainable(judge_run, judge_server):
    ids = job_submit_episodes(
        run=judge_run, episodes=[_episode("4", "g1"), _episode("5", "g1"), _episode("four", "g2")]
    )
    assert set(Session.objects.filter(pk__in=ids).values_list("trajectory", flat=True)) == {
        T.UNREWARDED
    }
    judge_run.refresh_from_db()
    assert judge_run.sessions_accepted == 0  # nothing trainable before the verdicts

    counts = rewards_tick()

    assert counts["opened"] == 3 and counts["scored"] == 3 and counts["calls"] == 3
    assert _rewards(judge_run) == {"4": 1.0, "5": 0.0, "four": 0.0}
    assert set(Session.objects.filter(pk__in=ids).values_list("trajectory", flat=True)) == {T.READY}
    judge_run.refresh_from_db()
    assert judge_run.sessions_accepted == 3  # the lifecycle moved the admission counters
    # The stored key went to the judge, decrypted; the judge was asked with the rubric.
    assert judge_server.auth == ["Bearer sk-judge-secret-123"] * 3
    assert "the number 4" in judge_server.requests[0]["messages"][-1]["content"]
    summary = reward_summary(run=judge_run)
    assert summary["calls"] == 3 and summary["prompt_tokens"] == 300
    assert summary["completion_tokens"] == 60 and summary["mean_latency_ms"] > 0


def test_the_judges_key_is_stored_encrypted_and_never_shown(judge_run, api, member_client, project):
    stored = json.dumps(Run.objects.get(pk=judge_run.pk).config)
    assert "sk-judge-secret-123" not in stored and "api_key_encrypted" in stored
    ciphertext = judge_run.config["reward"]["api_key_encrypted"]
    body = api.get(f"/api/v1/runs/{judge_run.id}/").content.decode()
    page = member_client.get(f"/projects/{project.id}/runs/{judge_run.id}/").content.decode()
    for shown in (body, page):
        assert "sk-judge-secret-123" not in shown and ciphertext not in shown
        assert "stored encrypted" in shown


def test_a_malformed_verdict_is_asked_again_once_then_the_session_is_unscored(
    judge_run, judge_server
):
    judge_server.mode = "garbage"
    (sid,) = job_submit_episodes(run=judge_run, episodes=[_episode("4", "g1")])

    rewards_tick()

    assert len(judge_server.requests) == 2  # the first answer and the one retry
    request = RewardRequest.objects.get(session_id=sid)
    assert request.state == RewardRequest.State.UNSCORED
    assert "judge reply invalid twice" in request.reason and "not JSON" in request.reason
    assert Session.objects.get(pk=sid).trajectory == T.UNREWARDED  # never trained
    summary = reward_summary(run=judge_run)
    assert summary["unscored"] == 1 and "not JSON" in summary["reasons"][0]["reason"]
    rewards_tick()
    assert len(judge_server.requests) == 2  # an unscored session is not asked about again


def test_one_malformed_verdict_then_a_valid_one_scores_the_session(judge_run, judge_server):
    judge_server.mode = "garbage-once"
    (sid,) = job_submit_episodes(run=judge_run, episodes=[_episode("4", "g1")])
    rewards_tick()
    assert len(judge_server.requests) == 2
    assert Session.objects.get(pk=sid).trajectory == T.READY
    call = JudgeCall.objects.get(run=judge_run)
    assert call.ok and call.prompt_tokens == 200  # both attempts cost tokens


def test_a_cached_verdict_costs_no_call(judge_run, judge_server):
    job_submit_episodes(run=judge_run, episodes=[_episode("4", "g1")])
    rewards_tick()
    assert len(judge_server.requests) == 1

    (again,) = job_submit_episodes(run=judge_run, episodes=[_episode("4", "g2")])
    counts = rewards_tick()

    assert len(judge_server.requests) == 1  # no second HTTP call
    assert counts["cached"] == 1 and Session.objects.get(pk=again).trajectory == T.READY
    assert Interaction.objects.get(session_id=again).reward == 1.0
    cached = JudgeCall.objects.get(run=judge_run, cached=True)
    assert (cached.prompt_tokens, cached.completion_tokens, cached.latency_ms) == (0, 0, 0.0)
    summary = reward_summary(run=judge_run)
    assert summary["calls"] == 1 and summary["cache_hits"] == 1 and summary["prompt_tokens"] == 100


def test_identical_answers_in_one_pass_share_one_call(judge_run, judge_server):
    ids = job_submit_episodes(run=judge_run, episodes=[_episode("4", "a"), _episode("4", "b")])
    rewards_tick()
    assert len(judge_server.requests) == 1
    assert set(Session.objects.filter(pk__in=ids).values_list("trajectory", flat=True)) == {T.READY}


@pytest.mark.parametrize("outage", ["down", "unreachable"])
def test_a_judge_outage_delays_scoring_and_loses_nothing(
    judge_run, judge_server, outage, project, make_dataset, make_run, judge_spec
):
    run = judge_run
    if outage == "unreachable":  # a port nothing listens on
        run = make_run(
            project,
            name="unreachable",
            dataset=make_dataset(project, name="p2"),
            reward=judge_spec | {"base_url": "http://127.0.0.1:9/v1"},
            group_size=2,
        )
    judge_server.mode = "down"
    ids = job_submit_episodes(run=run, episodes=[_episode("4", "g1"), _episode("5", "g1")])
    now = timezone.now()
    reward_requests_open(now=now)

    assert judge_due(now=now)["waiting"] == 2
    requests = RewardRequest.objects.filter(session_id__in=ids)
    assert {r.state for r in requests} == {RewardRequest.State.PENDING}
    assert {r.attempts for r in requests} == {1}
    assert all("waiting" in r.reason for r in requests)
    assert all(r.next_attempt_at > now + timedelta(seconds=9) for r in requests)  # backoff
    assert set(Session.objects.filter(pk__in=ids).values_list("trajectory", flat=True)) == {
        T.UNREWARDED
    }
    assert judge_due(now=now)["calls"] == 0  # not due again before the backoff ends

    judge_server.mode = "grade"
    if outage == "unreachable":
        spec = dict(run.config["reward"], base_url=judge_server.base_url)
        Run.objects.filter(pk=run.pk).update(config=run.config | {"reward": spec})
    # Due again once the backoff, counted from when each call failed, has passed.
    due = max(r.next_attempt_at for r in RewardRequest.objects.filter(session_id__in=ids))
    assert judge_due(now=due + timedelta(seconds=1))["scored"] == 2
    assert set(Session.objects.filter(pk__in=ids).values_list("trajectory", flat=True)) == {T.READY}
    assert reward_summary(run=run)["outages"] == 2  # one failed call per session


def test_a_relative_judge_ranks_a_group_in_one_call(judge_run, judge_server):
    spec = dict(judge_run.config["reward"], relative=True)
    Run.objects.filter(pk=judge_run.pk).update(config=judge_run.config | {"reward": spec})
    ids = job_submit_episodes(
        run=judge_run, episodes=[_episode("5", "g1"), _episode("4", "g1"), _episode("4", "g2")]
    )
    rewards_tick()
    assert len(judge_server.requests) == 2  # one per group
    prompts = sorted(r["messages"][-1]["content"] for r in judge_server.requests)
    assert ["1 answers to" in prompts[0], "2 answers to" in prompts[1]] == [True, True]
    assert _rewards(judge_run) == {"5": 0.0, "4": 1.0}
    assert set(Session.objects.filter(pk__in=ids).values_list("trajectory", flat=True)) == {T.READY}


def test_online_sessions_that_end_unrewarded_are_judged(
    project, make_run, make_agent, make_session, judge_spec, judge_server
):
    run = make_run(project, reward=judge_spec)
    agent = make_agent(project, run=run)
    judged = make_session(
        agent,
        [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}],
        trajectory=T.UNREWARDED,
    )
    rewarded = make_session(
        agent, [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "5", "reward": 0.5}]
    )
    rewards_tick()
    judged.refresh_from_db()
    assert judged.trajectory == T.READY and judged.interactions.get().reward == 1.0
    assert judged.hint == "graded"  # the critique: a self-distilling run's teacher reads it
    assert not RewardRequest.objects.filter(session=rewarded).exists()  # it had its reward
    assert len(judge_server.requests) == 1


def test_a_judge_runs_job_submits_its_episodes_unscored_over_the_internal_api(
    client, judge_run, judge_server, set_status
):
    from webapp.runs.jobs import job_secret_issue

    set_status(judge_run, Run.Status.RUNNING)
    secret = job_secret_issue(run=judge_run)
    url = f"/internal/v1/runs/{judge_run.id}/episodes"

    def submit(episodes):
        return client.post(
            url,
            data={"episodes": episodes},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {secret}",
        )

    scored = submit([_episode("4", "g1") | {"reward": 1.0}])
    assert scored.status_code == 400 and "must be null" in scored.json()["error"]["message"]
    created = submit([_episode("4", "g1"), _episode("5", "g1")])
    assert created.status_code == 201, created.content
    ids = created.json()["sessions"]
    rewards_tick()
    assert _rewards(judge_run) == {"4": 1.0, "5": 0.0}
    assert set(Session.objects.filter(pk__in=ids).values_list("trajectory", flat=True)) == {T.READY}


def test_a_run_with_a_reward_function_refuses_unscored_episodes(
    client, project, make_dataset, make_run, set_status
):
    from webapp.runs.jobs import job_secret_issue

    run = set_status(make_run(project, dataset=make_dataset(project), group_size=2), "running")
    secret = job_secret_issue(run=run)
    response = client.post(
        f"/internal/v1/runs/{run.id}/episodes",
        data={"episodes": [_episode("4", "g1")]},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    assert response.status_code == 400
    assert "reward' must be a finite number" in response.json()["error"]["message"]
    assert not Session.objects.filter(run=run).exists()
