"""Chaos tests: a live Steep stack (web, Celery worker + beat, a local Ray head, the runs'
jobs with the tiny model on the torch engine), runs on the real job path, and the ledger
check every fault must pass.

- ``chaos_stack``: the stack, with ``STEEP_FAILPOINTS`` pointing at a file the test arms
  (``stack.arm([...])``, ``rl_core.failpoints``) and the reconciler looking every 2 s, so a
  crashed run restarts soon after its job dies.
- ``rest``: an httpx client on ``/api/v1`` with a project key.
- ``start_dataset_run(rest, stack, **settings)``: a lean dataset run (toy task, small
  batches), started; ``wait_status(rest, run_id, status, timeout)``.
- ``assert_ledger_exact(rest, run_id, batch_size=...)``: the ledger, read from outside, is
  exact: accepted = trained once + dropped (with reason) + pending, nothing trained twice,
  each step of the final lineage trained exactly one batch, and the database agrees.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rl_core.failpoints import arm
from rl_core.toy import TOY_SETTINGS, toy_rows
from tests.conftest import test_database_url
from tests.livestack import LiveStack, answers, free_port, steep_env, wait_for

LEAN = {
    **TOY_SETTINGS,
    "batch_size": 8,
    "group_size": 4,
    "max_staleness": 1,
    "max_steps": 8,
    "save_every": 2,
}


@dataclass
class ChaosStack:
    url: str
    model_dir: Path
    failpoints: Path
    processes: LiveStack

    def arm(self, entries: list[dict]) -> None:
        """Where the next runs' trainers kill themselves (each entry once)."""
        arm(self.failpoints, entries)

    def armed(self) -> list[dict]:
        return json.loads(self.failpoints.read_text())

    def log_tail(self, lines: int = 80) -> str:
        return self.processes.log_tail(lines)


@pytest.fixture(scope="module")
def chaos_stack(django_db_setup, tmp_path_factory):
    from django.conf import settings

    from rl_core.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat")
    failpoints = tmp_path_factory.mktemp("chaos") / "failpoints.json"
    arm(failpoints, [])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = steep_env(
        data_dir=settings.DATA_DIR,
        database_url=test_database_url(),
        redis_url=settings.REDIS_URL,
        site_url=url,
        local_ray=True,
        STEEP_FAILPOINTS=str(failpoints),
        RUN_RECONCILE_INTERVAL_S="2",
        STEEP_DEMO_AGENT="false",
    )
    with LiveStack(env=env, log_dir=tmp_path_factory.mktemp("logs")) as processes:
        web = processes.start_web(port)
        processes.start_worker()
        processes.wait_ready(web, lambda: answers(f"{url}/login/"), what="the web server")
        yield ChaosStack(url=url, model_dir=model_dir, failpoints=failpoints, processes=processes)


@pytest.fixture
def rest(chaos_stack, api_key):
    with httpx.Client(
        base_url=f"{chaos_stack.url}/api/v1",
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    ) as client:
        yield client


def start_dataset_run(rest, stack: ChaosStack, **overrides) -> dict:
    """Create a lean dataset run on the toy task (128 rows: more than a short run's groups,
    so no prompt may repeat) and start it."""
    body = "".join(json.dumps(row) + "\n" for row in toy_rows(128)).encode()
    dataset = rest.post(
        "/datasets/",
        data={"name": f"letters-{time.time_ns()}"},
        files={"file": ("letters.jsonl", body)},
    )
    assert dataset.status_code == 201, dataset.text
    created = rest.post(
        "/runs/",
        json={
            "name": "chaos",
            "mode": "dataset",
            "base_model": str(stack.model_dir),
            "dataset": dataset.json()["id"],
            **LEAN,
            **overrides,
        },
    )
    assert created.status_code == 201, created.text
    run = created.json()
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    return run


def wait_status(rest, stack: ChaosStack, run_id: str, status: str, timeout: float) -> dict:
    def reached():
        state = rest.get(f"/runs/{run_id}/").json()
        return state if state["status"] == status else None

    return wait_for(reached, timeout, f"the run to be {status}\n{stack.log_tail()}")


def assert_ledger_exact(rest, run_id: str, *, batch_size: int, steps: int) -> dict:
    """The run's ledger (``GET /api/v1/runs/<id>/ledger/``) balances, read from outside, and
    the database says the same. Returns the ledger."""
    from webapp.gateway.models import Session, TrainingRecord

    response = rest.get(f"/runs/{run_id}/ledger/")
    assert response.status_code == 200, response.text
    ledger = response.json()
    assert ledger["trained_twice"] == [], ledger
    assert ledger["accepted"] == ledger["trained"] + ledger["dropped"] + ledger["pending"], ledger
    assert sum(ledger["dropped_by_reason"].values()) == ledger["dropped"], ledger
    assert all(reason for reason in ledger["dropped_by_reason"]), ledger
    # The final lineage: steps 1..steps, each one batch, each trajectory once.
    assert ledger["trained_by_step"] == [
        {"step": step, "count": batch_size} for step in range(1, steps + 1)
    ], ledger
    assert ledger["trained"] == batch_size * steps and ledger["balanced"] is True, ledger

    sessions = Session.objects.filter(run_id=run_id)
    records = TrainingRecord.objects.filter(run_id=run_id)
    trained = set(sessions.filter(trajectory="trained").values_list("id", flat=True))
    assert set(records.values_list("session_id", flat=True)) == trained
    assert records.count() == len(trained) == ledger["trained"]
    assert not sessions.filter(trajectory="claimed").exists(), "the run ended: nothing claimed"
    went_to_training = sessions.exclude(trajectory__in=["pending", "unrewarded"]).count()
    assert went_to_training == ledger["accepted"]
    for session in sessions.filter(trajectory="trained"):
        assert 1 <= session.trained_version <= steps, session.trained_version
    return ledger
