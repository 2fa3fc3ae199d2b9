"""A project key's stream starts its engine request beside the begin trip when its caller's last
stream was served recently (``early.EARLY_RUNS``), so the time to the first token no longer
includes the trip; when the trip then refuses, or names another run, the early request is
aborted and nothing of it is recorded. In-process (the real lane, the shared torch engine),
so the test sees the engine's state while the begin trip is still under way."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.gateway.test_retries import HI, _slow
from webapp.gateway import completions, early
from webapp.gateway.lane import in_lane
from webapp.gateway.models import Interaction

pytestmark = pytest.mark.django_db(transaction=True)


async def _engine(engine, name: str) -> int:
    async with httpx.AsyncClient(timeout=10) as client:
        info = (await client.get(engine.url + "/get_server_info")).json()
    return info["internal_states"][0][name]


async def _running_soon(engine, deadline_s: float = 10.0) -> bool:
    """Whether the engine has a request running within ``deadline_s`` (polled)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        if await _engine(engine, "num_running_reqs"):
            return True
        await asyncio.sleep(0.05)
    return False


def _stream(gw, db=in_lane, max_tokens: int = 4):
    # Greedy: a sampled stop token could end it before it is seen running or aborted.
    body = {
        "model": gw.model,
        "messages": HI,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }

    async def call():
        reply = await completions.chat_completion(
            agent_id=str(gw.agent.id),
            authorization=f"Bearer {gw.key}",
            content_type="application/json",
            body=json.dumps(body).encode(),
            db=db,
        )
        chunks = [chunk async for chunk in reply.stream] if reply.stream else []
        return reply, b"".join(chunks)

    return call()


def test_a_repeated_stream_is_generating_before_its_begin_trip_answers(gw, engine):
    begin_saw_engine: list[bool] = []

    async def watching(operation, durable=True):
        if not begin_saw_engine:  # the begin trip: does the engine already generate?
            begin_saw_engine.append(await _running_soon(engine))
        return await in_lane(operation, durable=durable)

    async def scenario():
        early.EARLY_RUNS.forget((str(gw.agent.id), _key_hash(gw)))
        first, _ = await _stream(gw)  # served the usual way: its run is remembered
        assert first.status == 200
        with _slow(engine):
            reply, body = await _stream(gw, db=watching)
        return reply, body

    reply, body = asyncio.run(scenario())
    assert begin_saw_engine == [True]
    assert reply.status == 200 and body.endswith(b"data: [DONE]\n\n")
    last = Interaction.objects.order_by("-created_at").first()
    assert json.loads(body.split(b"\n")[0][6:])["id"] == last.id
    assert last.session.run_id == gw.run.id and not last.aborted


def test_without_a_recent_stream_nothing_starts_before_the_begin_trip(gw, engine):
    begin_saw_engine: list[bool] = []

    async def watching(operation, durable=True):
        if not begin_saw_engine:
            begin_saw_engine.append(await _running_soon(engine, deadline_s=1.0))
        return await in_lane(operation, durable=durable)

    async def scenario():
        early.EARLY_RUNS.forget((str(gw.agent.id), _key_hash(gw)))
        with _slow(engine):
            return await _stream(gw, db=watching)

    reply, _ = asyncio.run(scenario())
    assert begin_saw_engine == [False] and reply.status == 200


def test_a_refused_begin_trip_aborts_the_early_request_and_records_nothing(gw, engine):
    from webapp.runs.models import Run

    async def scenario():
        first, _ = await _stream(gw)
        assert first.status == 200
        await asyncio.to_thread(Run.objects.filter(pk=gw.run.id).update, status=Run.Status.STOPPED)
        aborted = await _engine(engine, "num_aborted_reqs")
        with _slow(engine):
            reply, body = await _stream(gw, max_tokens=8)
            for _ in range(200):  # the early request's abort reaches the engine
                if await _engine(engine, "num_aborted_reqs") > aborted:
                    break
                await asyncio.sleep(0.05)
            return reply, body, await _engine(engine, "num_aborted_reqs") - aborted

    reply, body, aborted = asyncio.run(scenario())
    assert reply.status == 503 and b"run_not_running" in reply.body
    assert aborted == 1
    assert Interaction.objects.count() == 1  # the first stream's only


def _key_hash(gw) -> str:
    from webapp.accounts.keys import hash_key

    return hash_key(gw.key)


def test_an_early_request_for_a_run_the_agent_left_is_dropped_for_one_on_its_new_run(
    gw, engine, make_run
):
    from webapp.agents.services import agent_bind_run
    from webapp.gateway.services import inference_server_register
    from webapp.runs.services import run_mark_running

    new_run = make_run(gw.project, name="next-run", base_model=str(gw.model_dir))
    inference_server_register(run=new_run, url=engine.url, backend="torch")
    new_run = run_mark_running(run=new_run, message="test")

    async def scenario():
        first, _ = await _stream(gw)
        assert first.status == 200
        await asyncio.to_thread(agent_bind_run, agent=gw.agent, run=new_run)
        aborted = await _engine(engine, "num_aborted_reqs")
        with _slow(engine):
            reply, body = await _stream(gw, max_tokens=8)
        return reply, body, await _engine(engine, "num_aborted_reqs") - aborted

    reply, body, aborted = asyncio.run(scenario())
    assert reply.status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert aborted == 1  # the early request, made for the old run
    last = Interaction.objects.order_by("-created_at").first()
    assert last.session.run_id == new_run.id and not last.aborted
