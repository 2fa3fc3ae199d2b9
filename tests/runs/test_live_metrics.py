"""Live metrics: a websocket subscriber gets the snapshot, then each step's metric event."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from webapp.asgi import application
from webapp.runs.jobs import job_report_metrics

pytestmark = pytest.mark.django_db(transaction=True)


async def _connect(run, user, since=-1):
    from channels.auth import login  # noqa: F401  (session auth is what the browser uses)
    from django.test import Client

    client = Client()
    await sync_to_async(client.force_login)(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}"
    communicator = WebsocketCommunicator(
        application,
        f"/ws/runs/{run.id}/?since_step={since}",
        headers=[(b"cookie", cookie.encode()), (b"origin", b"http://127.0.0.1:8000")],
    )
    connected, _ = await communicator.connect()
    return communicator, connected


async def test_a_subscriber_receives_metric_events_as_steps_complete(project, owner, make_run):
    run = await sync_to_async(make_run)(project)
    await sync_to_async(job_report_metrics)(
        run=run, step=1, version=1, metrics={"rollout/reward": 0.1}
    )
    communicator, connected = await _connect(run, owner)
    assert connected
    snapshot = await communicator.receive_json_from(timeout=5)
    assert snapshot["type"] == "snapshot"
    assert [p["value"] for p in snapshot["metrics"]] == [0.1]

    await sync_to_async(job_report_metrics)(
        run=run, step=2, version=2, metrics={"rollout/reward": 0.7}
    )
    event = await communicator.receive_json_from(timeout=5)
    assert event["type"] == "metrics" and event["step"] == 2 and event["weight_version"] == 2
    stored = await sync_to_async(run.metrics.get)(step=2)
    # "t" (when the point was stored, unix seconds) lets the dashboard chart over time.
    assert event["points"] == [
        {"step": 2, "name": "rollout/reward", "value": 0.7, "t": stored.created_at.timestamp()}
    ]
    await communicator.disconnect()


async def test_reconnecting_resumes_after_the_last_step_seen(project, owner, make_run):
    run = await sync_to_async(make_run)(project)
    for step in (1, 2, 3):
        await sync_to_async(job_report_metrics)(
            run=run, step=step, version=step, metrics={"ppo/loss": float(step)}
        )
    communicator, connected = await _connect(run, owner, since=2)
    assert connected
    snapshot = await communicator.receive_json_from(timeout=5)
    assert [p["step"] for p in snapshot["metrics"]] == [3]
    await communicator.disconnect()


async def test_it_validates_ownership_a_non_member_cannot_subscribe(project, other_user, make_run):
    run = await sync_to_async(make_run)(project)
    communicator, connected = await _connect(run, other_user)
    assert not connected


async def test_a_run_id_that_is_not_a_uuid_is_refused(owner):
    class NotARun:
        id = "not-a-uuid"

    communicator, connected = await _connect(NotARun, owner)
    assert not connected
