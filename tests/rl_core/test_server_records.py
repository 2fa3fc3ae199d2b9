"""Inference servers run in sessions of their own, so nothing that stops their owner's process
group reaches them. Recorded in a ``pid_dir`` while they run, they can be found and stopped
by PID even when their owner died without stopping them; a torch engine started by a
launcher also exits by itself when its owner dies (``rl_core.inference.process``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rl_core.inference.process import (
    InferenceServer,
    group_alive,
    signal_group,
    take_recorded_groups,
)

# A server that starts a child (as SGLang starts its scheduler) and waits.
SERVER = (
    "import subprocess, sys, time;"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
    "time.sleep(120)"
)


class StandIn(InferenceServer):
    backend = "stand-in"

    def command(self) -> list[str]:
        return [sys.executable, "-c", SERVER]


def wait_until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_server_is_recorded_while_it_runs(tmp_path):
    server = StandIn("model", port=1, pid_dir=tmp_path / "pids", log_path=tmp_path / "log")
    server.start()
    try:
        [record] = (tmp_path / "pids").glob("*.json")
        data = json.loads(record.read_text())
        assert data["pid"] == server.process.pid and data["backend"] == "stand-in"
        assert data["url"] == "http://127.0.0.1:1" and data["start_time"]
    finally:
        server.stop(timeout=10)
    assert list((tmp_path / "pids").glob("*.json")) == []


def test_a_recorded_server_whose_owner_died_is_stopped_with_its_children(tmp_path):
    pids = tmp_path / "pids"
    # The owner starts a recorded server and is killed before it can stop it.
    owner_code = textwrap.dedent(
        f"""
        import sys, time
        from rl_core.inference.process import InferenceServer

        class StandIn(InferenceServer):
            backend = "stand-in"

            def command(self):
                return [sys.executable, "-c", {SERVER!r}]

        StandIn("model", port=1, pid_dir={str(pids)!r}, log_path={str(tmp_path / "log")!r}).start()
        time.sleep(120)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], env=os.environ)
    try:
        wait_until(lambda: list(pids.glob("*.json")))
        [pgid] = [json.loads(path.read_text())["pid"] for path in pids.glob("*.json")]
        wait_until(lambda: _members(pgid) >= 2)  # the server and its child
        owner.kill()
        owner.wait(timeout=10)
        assert group_alive(pgid), "an orphaned server keeps running"

        assert take_recorded_groups(pids) == [pgid]
        assert signal_group(pgid, signal.SIGTERM)
        wait_until(lambda: not group_alive(pgid))
    finally:
        owner.kill()
        owner.wait(timeout=10)
        for path in pids.glob("*.json"):
            signal_group(json.loads(path.read_text())["pid"], signal.SIGKILL)
    assert list(pids.glob("*.json")) == [], "the records are taken"


def test_a_record_whose_pid_now_names_another_process_is_left_alone(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    # This test's own PID, recorded as if an older process had had it.
    (pids / f"{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid(), "start_time": 1}))
    (pids / "garbage.json").write_text("not json")
    assert take_recorded_groups(pids) == []
    assert list(pids.glob("*.json")) == []


def test_a_torch_engine_exits_when_its_owner_dies(tmp_path, tiny_model_dir):
    # The owner starts the engine (in a session of its own, as TorchEngineServer does), reports
    # its PID and is killed: the engine must not outlive it.
    owner_code = textwrap.dedent(
        f"""
        import sys, time
        from rl_core.inference.launch import TorchEngineServer
        server = TorchEngineServer({str(tiny_model_dir)!r}, num_threads=1,
                                   log_path={str(tmp_path / "engine.log")!r})
        server.start()
        print(server.process.pid, flush=True)
        time.sleep(120)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    engine = int(owner.stdout.readline())

    def arguments() -> list[str]:
        return Path(f"/proc/{engine}/cmdline").read_text().split("\0")

    try:
        # Popen returns once the exec has begun (vfork), not when it is done: for a moment
        # the new program has no command line yet (seen in a loaded CI lane: state R, 4 kB
        # mapped, cmdline empty). Wait for it; if it never comes, say what the engine was.
        wait_until(lambda: arguments() != [""] or not alive(engine), timeout=10)
        command = arguments()
        assert "--parent-pid" in command, (
            command,
            Path(f"/proc/{engine}/stat").read_text(),
            (tmp_path / "engine.log").read_text()[-3000:],
        )
        assert command[command.index("--parent-pid") + 1] == str(owner.pid)
        owner.kill()
        owner.wait(timeout=10)
        wait_until(lambda: not alive(engine), timeout=60)
    finally:
        owner.kill()
        owner.wait(timeout=10)
        signal_group(engine, signal.SIGKILL)


def _members(pgid: int) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            count += int(fields[2]) == pgid and fields[0] != "Z"
    return count
