"""The run's admission counters (``Run.sessions_open`` / ``sessions_accepted``) follow its
sessions through the real gateway, and ``admission.refresh`` restores them from the rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from webapp.gateway import admission
from webapp.gateway.models import Session
from webapp.gateway.tasks import sessions_expire_idle
from webapp.runs.jobs import job_mark_trained, job_submit_episodes
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]


def counters(run) -> tuple[int, int]:
    run = Run.objects.get(pk=run.pk)
    return run.sessions_open, run.sessions_accepted


def truth(run) -> tuple[int, int]:
    sessions = Session.objects.filter(run=run)
    return (
        sessions.filter(status="open").count(),
        sessions.filter(trajectory__in=admission.ACCEPTED).count(),
    )


def test_counters_follow_a_session_through_its_life(gw):
    assert counters(gw.run) == (0, 0)
    _, key = gw.start_session()
    assert counters(gw.run) == (1, 0)
    gw.openai(key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    assert gw.post("/rl/end_session", key=key).status_code == 200
    assert counters(gw.run) == (0, 1) == truth(gw.run)

    # Ended without a reward: the slot comes back, nothing is accepted.
    _, key = gw.start_session()
    assert gw.post("/rl/end_session", key=key).status_code == 200
    assert counters(gw.run) == (0, 1) == truth(gw.run)


def test_a_one_turn_completion_holds_a_slot_until_its_reward_accepts_it(gw):
    reply = gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert counters(gw.run) == (1, 0) == truth(gw.run)
    assert gw.post("/rl/set_reward", {"reward": 1.0, "interaction_id": reply.id}).status_code == 200
    assert counters(gw.run) == (0, 1) == truth(gw.run)


def test_a_failed_one_turn_completion_gives_its_slot_back(make_gateway, project, api_key):
    from rl_core.inference.launch import free_port

    gw = make_gateway(project, api_key, servers=[f"http://127.0.0.1:{free_port()}"])
    response = gw.post("/chat/completions", {"model": gw.model, "messages": HI, "max_tokens": 2})
    assert response.status_code == 503, response.text
    assert counters(gw.run) == (0, 0) == truth(gw.run)


def test_dropped_trajectories_give_their_slots_back(gw):
    ids = []
    for _ in range(2):
        session_id, key = gw.start_session()
        gw.openai(key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
        gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
        gw.post("/rl/end_session", key=key)
        ids.append(session_id)
    Session.objects.filter(pk__in=ids).update(trajectory="claimed")
    job_mark_trained(run=gw.run, version=1, trained=[ids[0]], dropped=[ids[1]])
    assert counters(gw.run) == (0, 1) == truth(gw.run)


def test_refresh_recomputes_counters_from_the_sessions(gw):
    gw.start_session()
    gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    Run.objects.filter(pk=gw.run.pk).update(sessions_open=57, sessions_accepted=-3)
    with connection.cursor() as cursor:
        admission.refresh(cursor, gw.run.pk)
    assert counters(gw.run) == truth(gw.run) == (2, 0)


def test_concurrent_start_sessions_take_exactly_the_free_slots(make_gateway, project, api_key):
    gw = make_gateway(project, api_key, max_staleness=0, batch_size=5)
    with ThreadPoolExecutor(max_workers=12) as pool:
        statuses = list(pool.map(lambda _: gw.post("/rl/start_session").status_code, range(12)))
    assert statuses.count(201) == 5 and statuses.count(429) == 7, statuses
    assert counters(gw.run) == (5, 0) == truth(gw.run)


def test_rebinding_a_live_key_accepts_the_old_session_and_opens_the_new_one(gw):
    _, key = gw.start_session()
    gw.openai(key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)

    assert gw.post("/rl/start_session", key=key).status_code == 201
    assert counters(gw.run) == (1, 1) == truth(gw.run)


def test_expired_sessions_give_their_slots_back(gw, settings):
    settings.SESSION_IDLE_TIMEOUT_S = 2
    gw.start_session()
    _, key = gw.start_session()
    gw.openai(key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)  # rewarded, but incomplete: not trained
    Session.objects.update(last_activity_at=timezone.now() - timedelta(seconds=3))

    assert sessions_expire_idle() == 2
    assert counters(gw.run) == (0, 0) == truth(gw.run)


def test_the_expiry_task_gives_back_the_slots_of_sessions_deleted_with_their_agent(gw):
    gw.start_session()
    gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.agent.delete()  # its sessions go with it; the counters cannot follow
    assert counters(gw.run) == (2, 0) and truth(gw.run) == (0, 0)

    sessions_expire_idle()
    assert counters(gw.run) == (0, 0)


def test_refresh_touches_only_its_own_run(project, make_run, make_agent):
    runs = [make_run(project, name=name) for name in ("mine", "other")]
    agent = make_agent(project, run=runs[0])
    for status, trajectory in [
        ("open", "pending"),
        ("ended", "ready"),
        ("ended", "claimed"),
        ("ended", "trained"),
        ("ended", "dropped"),
        ("expired", "unrewarded"),
    ]:
        Session.objects.create(
            project=project, agent=agent, run=runs[0], status=status, trajectory=trajectory
        )
    Run.objects.update(sessions_open=9, sessions_accepted=9)

    with connection.cursor() as cursor:
        admission.refresh(cursor, runs[0].pk)

    assert counters(runs[0]) == truth(runs[0]) == (1, 3)
    assert counters(runs[1]) == (9, 9)


def test_submitted_dataset_episodes_are_accepted(project, make_run):
    run = make_run(project)
    episode = {
        "input_ids": [1, 2],
        "output_ids": [3],
        "logprobs": [-0.5],
        "versions": [0],
        "reward": 1.0,
    }
    job_submit_episodes(run=run, episodes=[episode, episode, episode])
    assert counters(run) == (0, 3) == truth(run)


def test_completions_and_start_sessions_racing_share_exactly_the_free_slots(
    make_gateway, project, api_key
):
    # One-turn completions are admitted in the fast route's lane, start_session in Django's
    # view: both take slots with the same conditional UPDATE.
    gw = make_gateway(project, api_key, max_staleness=0, batch_size=4)
    chat = {"model": gw.model, "messages": HI, "max_tokens": 2}

    def call(i: int) -> int:
        if i % 2:
            return gw.post("/chat/completions", chat).status_code
        return gw.post("/rl/start_session").status_code

    with ThreadPoolExecutor(max_workers=12) as pool:
        statuses = list(pool.map(call, range(12)))

    assert statuses.count(200) + statuses.count(201) == 4, statuses
    assert statuses.count(429) == 8, statuses
    assert counters(gw.run) == (4, 0) == truth(gw.run)
