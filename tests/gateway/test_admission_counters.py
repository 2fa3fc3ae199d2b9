"""The run's admission counters (``Run.sessions_open`` / ``sessions_accepted``) follow its
sessions through the real gateway, and ``admission.refresh`` restores them from the rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from webapp.gateway import admission
from webapp.gateway.models import Session
from webapp.runs.jobs import job_mark_trained
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
