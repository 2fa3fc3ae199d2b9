"""Stopping the local Ray head stops what Steep started for this DATA_DIR (the head and the
runs' inference servers), and nothing else (no ``ray stop --force``, which ends every Ray
process of the user on the machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_core.inference.process import record_process
from tests.livestack import free_port
from workers import ray_cluster
from workers.ray_cluster import (
    RayUnavailable,
    _pids_naming,
    _ray_temp_dir,
    _running,
    inference_pid_dir,
    stop_local_cluster,
)

# A process that starts a child (as the raylet starts its agents) and then waits; its
# command line names a directory, as a Ray head's processes name their temp dir.
PARENT = (
    "import subprocess, sys, time;"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
    "time.sleep(120)"
)


def children_of(pid: int) -> list[int]:
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and (entry / "stat").exists() and _parent(entry) == pid
    ]


def _parent(entry: Path) -> int | None:
    try:
        return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_it_stops_the_heads_processes_and_their_children_and_no_other(tmp_path):
    ours = tmp_path / "ours"
    theirs = tmp_path / "theirs"
    head = subprocess.Popen([sys.executable, "-c", PARENT, f"--temp-dir={_ray_temp_dir(ours)}"])
    other = subprocess.Popen([sys.executable, "-c", PARENT, f"--temp-dir={_ray_temp_dir(theirs)}"])
    try:
        deadline = time.monotonic() + 30
        while not (children_of(head.pid) and children_of(other.pid)):
            assert time.monotonic() < deadline, "the stand-in processes did not start"
            time.sleep(0.05)
        [agent] = children_of(head.pid)
        (ours / "ray").mkdir(parents=True)
        (ours / "ray" / "head.json").write_text("{}")

        stopped = stop_local_cluster(data_dir=ours, grace_s=5)

        assert set(stopped) == {head.pid, agent}
        head.wait(timeout=10)
        assert not _running(agent)
        assert other.poll() is None and all(_running(pid) for pid in children_of(other.pid))
        assert not (ours / "ray" / "head.json").exists()
    finally:
        for process in (head, other):
            for pid in children_of(process.pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
            process.kill()
            process.wait(timeout=10)


def test_it_stops_the_runs_inference_servers_recorded_for_its_data_dir_and_no_other(tmp_path):
    # Servers run in sessions of their own, and may have outlived the Ray workers that
    # started them: they are found by their records, not by their parents.
    servers = {}
    for name in ("ours", "theirs"):
        server = subprocess.Popen(
            [sys.executable, "-c", PARENT], start_new_session=True
        )  # a server and its child, in a group of their own
        record_process(inference_pid_dir(tmp_path / name), server.pid, backend="torch")
        servers[name] = server
    try:
        deadline = time.monotonic() + 30
        while not all(children_of(server.pid) for server in servers.values()):
            assert time.monotonic() < deadline, "the stand-in servers did not start"
            time.sleep(0.05)
        [child] = children_of(servers["ours"].pid)

        stopped = stop_local_cluster(data_dir=tmp_path / "ours", grace_s=5)

        assert stopped == [servers["ours"].pid]
        servers["ours"].wait(timeout=10)
        assert not _running(child)
        assert servers["theirs"].poll() is None
        assert list(inference_pid_dir(tmp_path / "ours").iterdir()) == []
    finally:
        for server in servers.values():
            for pid in children_of(server.pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
            server.kill()
            server.wait(timeout=10)


def test_it_stops_job_drivers_a_dead_head_left_behind_and_no_other(tmp_path):
    # A run's job driver outlives its head when the head dies first (the worker that started
    # it was killed): it names no temp dir, but its environment names the head's token.
    drivers = {}
    for name in ("ours", "theirs"):
        env = dict(os.environ, RAY_AUTH_TOKEN_PATH=str(tmp_path / name / "ray" / "auth_token"))
        drivers[name] = subprocess.Popen(
            [sys.executable, "-c", PARENT, "-m", "workers.ray_job"], env=env
        )
    try:
        deadline = time.monotonic() + 30
        while not all(children_of(driver.pid) for driver in drivers.values()):
            assert time.monotonic() < deadline, "the stand-in drivers did not start"
            time.sleep(0.05)
        [child] = children_of(drivers["ours"].pid)

        stopped = stop_local_cluster(data_dir=tmp_path / "ours", grace_s=5)

        assert set(stopped) == {drivers["ours"].pid, child}
        drivers["ours"].wait(timeout=10)
        assert not _running(child)
        assert drivers["theirs"].poll() is None
    finally:
        for driver in drivers.values():
            for pid in children_of(driver.pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
            driver.kill()
            driver.wait(timeout=10)


def test_a_started_head_whose_jobs_api_never_answers_is_stopped_not_left_behind(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(ray_cluster, "_alive", lambda url: False)
    monkeypatch.setattr(ray_cluster, "JOBS_API_WAIT_S", 1.0)
    marker = str(_ray_temp_dir(tmp_path))
    try:
        with pytest.raises(RayUnavailable, match="never answered"):
            ray_cluster.ensure_cluster(
                data_dir=tmp_path, num_cpus=1, dashboard_port=free_port(), gcs_port=free_port()
            )
        deadline = time.monotonic() + 10  # SIGKILLed processes are gone within moments
        while _pids_naming(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _pids_naming(marker) == []
        assert not (tmp_path / "ray" / "head.json").exists()
    finally:
        stop_local_cluster(data_dir=tmp_path)
