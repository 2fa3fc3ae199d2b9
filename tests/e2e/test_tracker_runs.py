"""Experiment trackers on real dataset runs (REST → Celery → Ray job → trainer): W&B (offline),
MLflow (the run's file store) and TensorBoard hold exactly the metrics the run's metrics API
serves, read back with each one's own reader; a tracker that fails leaves the run completing,
and its page says so."""

from __future__ import annotations

import json
import os
import time

import pytest

from rl_core.toy import TOY_SETTINGS, toy_rows
from tests import wandb_offline
from tests.livestack import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
STEPS = 3


def start_run(rest, stack, trackers: dict) -> str:
    body = "".join(json.dumps(row) + "\n" for row in toy_rows(64)).encode()
    dataset = rest.post(
        "/datasets/",
        data={"name": f"letters-{time.time_ns()}"},
        files={"file": ("letters.jsonl", body)},
    ).json()
    created = rest.post(
        "/runs/",
        json={
            "name": "tracked",
            "mode": "dataset",
            "base_model": str(stack.model_dir),
            "dataset": dataset["id"],
            **TOY_SETTINGS,
            "batch_size": 8,
            "max_steps": STEPS,
            "save_every": STEPS,
            "trackers": trackers,
        },
    )
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    assert rest.post(f"/runs/{run_id}/start/").status_code == 202
    return run_id


def wait_completed(rest, stack, run_id: str) -> None:
    wait_for(
        lambda: rest.get(f"/runs/{run_id}/").json()["status"] in ("completed", "failed"),
        600,
        f"run {run_id} to end\n{stack.log_tail()}",
    )
    run = rest.get(f"/runs/{run_id}/").json()
    assert run["status"] == "completed", f"{run.get('error')}\n{stack.log_tail()}"


def api_metrics(rest, run_id: str) -> dict[str, dict[int, float]]:
    """name → step → value, as the run's metrics API serves them."""
    series: dict[str, dict[int, float]] = {}
    page = f"/runs/{run_id}/metrics/?page_size=500"
    while page:
        body = rest.get(page).json()
        for point in body["results"]:
            series.setdefault(point["name"], {})[point["step"]] = point["value"]
        page = body["next"]
    return series


def test_trackers_hold_exactly_what_the_metrics_api_serves_and_a_failing_one_is_shown(
    stack, rest, owner, project
):
    from django.conf import settings
    from django.test import Client

    good = start_run(
        rest, stack, {"wandb": {"project": "steep-e2e"}, "mlflow": {}, "tensorboard": {}}
    )
    # An MLflow "server" that refuses every call: the web app itself answers its API with 404.
    refused = {"tracking_uri": f"{stack.url}/no-mlflow-here", "tracking_token": "t0ken"}
    bad = start_run(rest, stack, {"mlflow": refused, "tensorboard": {}})
    wait_completed(rest, stack, good)
    wait_completed(rest, stack, bad)

    served = api_metrics(rest, good)
    assert {step for steps in served.values() for step in steps} == set(range(1, STEPS + 1))
    run_dir = settings.DATA_DIR / "runs" / good

    history = wandb_offline.history(run_dir / "wandb")
    assert {
        (name, step): history[step][name] for name, steps in served.items() for step in steps
    } == {(name, step): value for name, steps in served.items() for step, value in steps.items()}

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run_dir / "mlruns").as_uri())
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("steep").experiment_id])
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["batch_size"] == "8"
    for name, steps in served.items():
        logged = client.get_metric_history(mlflow_run.info.run_id, name)
        assert {m.step: m.value for m in logged} == steps, name
    checkpoint = rest.get(f"/runs/{good}/checkpoints/").json()["results"][-1]
    assert mlflow_run.data.tags[f"checkpoint.step_{STEPS}"] == checkpoint["path"]

    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for name, steps in served.items():
        scalars = {e.step: e.value for e in events.Scalars(name)}
        assert scalars == {step: float(np.float32(v)) for step, v in steps.items()}, name

    # The failing tracker: the run completed all its steps, the page says MLflow stopped.
    assert set(api_metrics(rest, bad)["rollout/reward"]) == set(range(1, STEPS + 1))
    browser = Client()
    browser.force_login(owner)
    page = browser.get(f"/projects/{project.id}/runs/{bad}/").content.decode()
    assert 'id="run-trackers"' in page
    assert "MLflow: stopped mirroring this run at the start" in page
    assert "t0ken" not in page
    assert any((settings.DATA_DIR / "runs" / bad / "tensorboard").iterdir())
