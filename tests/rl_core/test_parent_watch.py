"""``when_parent_exits``: a child left running after its owner was killed ends too (the torch
engine and the eval subprocess use it). A real process tree: a shell that starts the child,
SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import os, sys, time
from rl_core.inference.process import when_parent_exits
when_parent_exits(int(sys.argv[1]), lambda: os._exit(0), every_s=0.1)
open(sys.argv[2], "w").write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_child_ends_when_its_parent_is_killed_and_not_before(tmp_path):
    pid_file = tmp_path / "child.pid"
    root = Path(__file__).resolve().parents[2]
    # The owner: a shell that starts the child with its own PID and waits.
    owner = subprocess.Popen(
        ["bash", "-c", f'"{sys.executable}" -c "$0" $$ "{pid_file}" & wait', CHILD],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    child = 0
    try:
        assert _wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
        child = int(pid_file.read_text())
        time.sleep(0.5)  # several checks of a live parent
        assert _alive(child), "the child ended while its parent lived"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert _wait_for(lambda: not _alive(child)), "the child outlived its killed parent"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
