"""Failpoints (``rl_core.failpoints``): a process SIGKILLs itself at a named place, once, and a
trainer killed in the middle of a checkpoint leaves nothing a run would resume from."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl_core.checkpoints import latest_checkpoint
from rl_core.failpoints import ENV, arm, failpoint

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, failpoints: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={"PATH": "/usr/bin:/bin", ENV: str(failpoints), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_without_the_variable_a_failpoint_does_nothing(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    failpoint("train_step", 10**6)


def test_an_unknown_failpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown failpoints"):
        arm(tmp_path / "f.json", [{"name": "train_stpe", "step": 1}])


def test_a_failpoint_kills_once_when_its_step_is_reached(tmp_path):
    failpoints = tmp_path / "f.json"
    arm(failpoints, [{"name": "checkpoint.write", "step": 9}, {"name": "train_step", "step": 2}])
    code = """
        from rl_core.failpoints import failpoint
        failpoint("train_step", 1); print("step 1", flush=True)
        failpoint("weight_sync.broadcast", 5); print("other place", flush=True)
        failpoint("train_step", 3); print("not reached", flush=True)
    """
    first = run_python(code, failpoints)
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert first.stdout.split("\n")[:2] == ["step 1", "other place"]
    assert json.loads(failpoints.read_text()) == [{"name": "checkpoint.write", "step": 9}]
    again = run_python(code, failpoints)  # consumed: the restarted process runs through
    assert again.returncode == 0 and "not reached" in again.stdout


@pytest.mark.slow
def test_a_trainer_killed_mid_checkpoint_leaves_no_checkpoint_to_resume(tmp_path, tiny_model_dir):
    failpoints, checkpoints = tmp_path / "f.json", tmp_path / "checkpoints"
    code = f"""
        import torch
        from rl_core.checkpoints import write_checkpoint
        from rl_core.config import RunConfig
        from rl_core.trainer import PPOTrainer
        torch.set_num_threads(1)
        cfg = RunConfig.from_dict({{"base_model": {str(tiny_model_dir)!r}, "mode": "online"}})
        trainer = PPOTrainer(cfg, device="cpu")
        from pathlib import Path
        write_checkpoint(trainer.save_checkpoint, Path({str(checkpoints)!r}), 0, 0)
        print("written", flush=True)
    """
    arm(failpoints, [{"name": "checkpoint.write", "step": 0}])
    killed = run_python(code, failpoints)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [p.name for p in checkpoints.iterdir()] == ["step_000000.tmp"]  # half written
    assert latest_checkpoint(checkpoints) is None

    written = run_python(code, failpoints)
    assert written.returncode == 0, written.stderr[-2000:]
    assert latest_checkpoint(checkpoints).path.name == "step_000000"
