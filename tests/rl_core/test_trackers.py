"""Experiment trackers (rl_core.trackers): what a run reports is mirrored to W&B (offline),
MLflow (a file store) and TensorBoard, read back with each one's own reader; a tracker that
fails is turned off, reported once, and the run's own reports go on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl_core.loop import ListReporter
from rl_core.tracker_specs import effective_trackers, tracker_params, tracker_spec_errors
from rl_core.trackers import TrackingReporter, make_trackers
from tests import wandb_offline

ROOT = Path(__file__).resolve().parents[2]
PARAMS = {"learning_rate": 1e-5, "reward.type": "exact_match", "lora_target_modules": "[]"}


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def step_values(step: int) -> dict[str, float]:
    return {
        "rollout/reward": step / 7,
        "loss/policy": -0.25 * step,
        "timing/step": 0.125 + step,
        "not_a_number": float("nan"),  # the web app keeps finite values only, and so do trackers
    }


async def report_a_run(trackers: dict, run_dir: Path, steps: int = 3) -> TrackingReporter:
    checkpoint = run_dir / "checkpoints" / f"step_{steps:08d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 64)
    reporter = TrackingReporter(
        ListReporter(), make_trackers(trackers, "run-1", "letters", run_dir)
    )
    await reporter.start(PARAMS)
    for step in range(1, steps + 1):
        await reporter.metrics(step, step, step_values(step))
    await reporter.checkpoint(steps, steps, str(checkpoint), 64)
    await reporter.evaluation(steps, {"mean_reward": 0.5, "pass_at_k": 0.75})
    await reporter.close("completed")
    return reporter


def expected(steps: int = 3) -> dict[int, dict[str, float]]:
    return {
        s: {k: v for k, v in step_values(s).items() if k != "not_a_number"}
        for s in range(1, steps + 1)
    }


def wandb_core_children() -> list[int]:
    """wandb's service processes this test process started that still run."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"wandb-core" in cmdline:
            found.append(int(stat.parent.name))
    return found


async def test_wandb_offline_receives_every_steps_metrics_the_config_and_checkpoints(tmp_path):
    reporter = await report_a_run({"wandb": {"project": "letters"}}, tmp_path)

    assert reporter.failed == {}
    history = wandb_offline.history(tmp_path / "wandb")
    for step, values in expected().items():
        assert {k: history[step][k] for k in values} == values
        assert "not_a_number" not in history[step]
    assert history[3]["eval/mean_reward"] == 0.5 and history[3]["eval/step"] == 3
    config = wandb_offline.config(tmp_path / "wandb")
    assert {k: config[k] for k in PARAMS} == PARAMS
    (artifact,) = wandb_offline.artifacts(tmp_path / "wandb")
    assert artifact.type == "model"
    assert json.loads(artifact.metadata)["path"].endswith("step_00000003")
    assert json.loads(artifact.metadata)["step"] == 3
    assert wandb_core_children() == []  # finish() and teardown() ended wandb's service


async def test_mlflow_file_store_receives_every_steps_metrics_params_and_checkpoints(tmp_path):
    from mlflow.tracking import MlflowClient

    reporter = await report_a_run({"mlflow": {"experiment": "letters"}}, tmp_path)

    assert reporter.failed == {}
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("letters").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["steep.run_id"] == "run-1"
    for name in expected()[1]:
        history = client.get_metric_history(run.info.run_id, name)
        assert [(m.step, m.value) for m in history] == [
            (step, values[name]) for step, values in expected().items()
        ]
    assert run.data.params == {k: str(v) for k, v in PARAMS.items()}
    assert run.data.tags["checkpoint.step_3"].endswith("step_00000003")
    evals = client.get_metric_history(run.info.run_id, "eval/pass_at_k")
    assert [(m.step, m.value) for m in evals] == [(3, 0.75)]


async def test_tensorboard_event_files_hold_every_steps_metrics(tmp_path):
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporter = await report_a_run({"tensorboard": {}}, tmp_path)

    assert reporter.failed == {}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for name in expected()[1]:
        assert [(e.step, e.value) for e in events.Scalars(name)] == [
            (step, float(np.float32(values[name]))) for step, values in expected().items()
        ]  # TensorBoard keeps float32
    assert [e.step for e in events.Scalars("eval/mean_reward")] == [3]
    assert "config" in " ".join(events.Tags()["tensors"])


async def test_a_tracker_that_fails_at_the_start_is_off_and_reported_once(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    trackers = {"mlflow": {"tracking_uri": (blocker / "mlruns").as_uri()}, "tensorboard": {}}

    reporter = await report_a_run(trackers, tmp_path)

    inner = reporter.inner
    assert [step for step, _, _ in inner.metrics_log] == [1, 2, 3]  # the run's reports went on
    assert len(inner.checkpoints) == 1
    (event,) = [e for e in inner.events if e[0] == "tracker"]
    assert event[1].startswith("MLflow: stopped mirroring this run at the start (")
    assert set(reporter.failed) == {"mlflow"}
    events_dir = tmp_path / "tensorboard"
    assert any(events_dir.iterdir())  # the other tracker went on


async def test_a_tracker_that_fails_mid_run_is_off_from_then_on(tmp_path):
    reporter = TrackingReporter(
        ListReporter(), make_trackers({"mlflow": {}}, "run-1", "letters", tmp_path)
    )
    await reporter.start(PARAMS)
    await reporter.metrics(1, 1, step_values(1))
    await reporter.flush()
    shutil.rmtree(tmp_path / "mlruns")  # the store is gone under it
    (tmp_path / "mlruns").write_text("a file where the store was")
    for step in (2, 3):
        await reporter.metrics(step, step, step_values(step))
    await reporter.close("completed")

    (event,) = [e for e in reporter.inner.events if e[0] == "tracker"]
    assert event[1].startswith("MLflow: stopped mirroring this run at step 2 (")
    assert [step for step, _, _ in reporter.inner.metrics_log] == [1, 2, 3]


async def test_a_tracker_whose_library_is_missing_is_off_and_the_run_goes_on(tmp_path):
    trackers = make_trackers({"tensorboard": {}}, "run-1", "letters", tmp_path)
    saved = sys.modules.get("torch.utils.tensorboard")
    sys.modules["torch.utils.tensorboard"] = None  # type: ignore[assignment]  # import fails
    try:
        reporter = TrackingReporter(ListReporter(), trackers)
        await reporter.start(PARAMS)
        await reporter.metrics(1, 1, step_values(1))
        await reporter.close("completed")
    finally:
        if saved is not None:
            sys.modules["torch.utils.tensorboard"] = saved
        else:
            del sys.modules["torch.utils.tensorboard"]

    assert (
        "ImportError" in reporter.failed["tensorboard"]
        or "ModuleNotFoundError" in (reporter.failed["tensorboard"])
    )
    assert len(reporter.inner.metrics_log) == 1


def test_specs_merge_the_instance_default_under_the_runs_setting():
    instance = {"tensorboard": {}, "mlflow": {"tracking_uri": "file:///srv/mlruns"}}
    assert effective_trackers(instance, {}) == instance
    assert effective_trackers(instance, {"mlflow": False}) == {"tensorboard": {}}
    assert effective_trackers(instance, {"mlflow": {"experiment": "x"}, "wandb": True}) == {
        "wandb": {},
        "mlflow": {"tracking_uri": "file:///srv/mlruns", "experiment": "x"},
        "tensorboard": {},
    }
    assert tracker_spec_errors({"mlflow": {"tracking_uri": "file:///srv"}}, instance=True) == []
    assert tracker_spec_errors({"mlflow": {"tracking_uri": "https://m.example.com"}}) == []
    assert "operator" in tracker_spec_errors({"mlflow": {"tracking_uri": "file:///srv"}})[0]


def test_tracker_params_leave_out_every_credential_and_the_trackers_setting():
    config = {
        "learning_rate": 1e-5,
        "max_new_tokens": 64,
        "reward": {"type": "judge", "api_key_encrypted": "gAAAA", "model": "m"},
        "trackers": {"wandb": {"api_key_encrypted": "gAAAA"}},
        "lora_target_modules": ["q_proj"],
    }
    assert tracker_params(config) == {
        "learning_rate": 1e-5,
        "max_new_tokens": 64,
        "reward.type": "judge",
        "reward.model": "m",
        "lora_target_modules": '["q_proj"]',
    }


def test_importing_the_loop_and_the_trackers_loads_no_tracker_library():
    code = (
        "import sys, rl_core.loop, rl_core.trackers, workers.ray_job\n"
        "print(sorted({'wandb', 'mlflow', 'tensorboard'} & {m.split('.')[0] for m in sys.modules}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
