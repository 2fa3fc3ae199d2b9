"""Where several processes' counters meet: prometheus_client's multiprocess mode.

A counter lives in the process that counts. Under ``uvicorn --workers N`` (the compose web
service runs 4) a scrape reaches one worker at random, so each worker writes its counters to
memory-mapped files in a directory the workers share, and ``/metrics`` sums the files
(``prometheus_client.multiprocess``). The mode is chosen per process by ``configure``:

- ``PROMETHEUS_MULTIPROC_DIR`` set: that directory, as the operator made it (another process
  manager; it must be empty when the server starts).
- a worker of a multi-process server (``uvicorn --workers N``, whose supervisor spawns its
  workers with ``multiprocessing``), or the Celery worker serving ``WORKER_METRICS_PORT``
  (whose prefork children count the tasks): ``DATA_DIR/metrics/<role>-<host>-<pid>-<start>``,
  named after the process that owns the group (the supervisor, the Celery main process), so
  the group's processes share it and the next server starts from zero. A directory whose
  owner is gone is removed by the next group on the same host.
- otherwise (``./steep up``, one uvicorn process): none; the counters stay in this process.

The directory is set in this process's environment, where prometheus_client reads it; the
processes a worker starts that use prometheus_client themselves (a local Ray head) are
started without it (``workers.ray_cluster``).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

from prometheus_client import values

ENV = "PROMETHEUS_MULTIPROC_DIR"


def configure(*, data_dir: Path, role: str, owner_pid: int | None) -> Path | None:
    """Switch this process to multiprocess mode and return its directory, or None (one process).

    ``owner_pid``: the process whose group shares the directory (None: this process alone,
    unless ``PROMETHEUS_MULTIPROC_DIR`` is set). Call before any metric has a value."""
    explicit = os.environ.get(ENV)
    if explicit:
        path = Path(explicit)
    elif owner_pid is None:
        return None
    else:
        base = data_dir / "metrics"
        host = socket.gethostname().replace("-", "_")
        _remove_stale(base, f"{role}-{host}-")
        path = base / f"{role}-{host}-{owner_pid}-{_started(owner_pid)}"
        os.environ[ENV] = str(path)
    path.mkdir(parents=True, exist_ok=True)
    if not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()
    return path


def web_owner() -> int | None:
    """The supervisor of this uvicorn worker when several run, else None."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else None


def _started(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot, from /proc), so that a reused PID is not
    taken for the process that had it; ``"0"`` where /proc is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "0"
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command's ")"


def _alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _started(pid) == started


def _remove_stale(base: Path, prefix: str) -> None:
    """Remove this host's directories of ``prefix`` whose owning process is gone."""
    if not base.is_dir():
        return
    for entry in base.iterdir():
        if not entry.name.startswith(prefix):
            continue
        pid, _, started = entry.name.removeprefix(prefix).partition("-")
        if pid.isdigit() and not _alive(int(pid), started):
            shutil.rmtree(entry, ignore_errors=True)


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the multiprocess directory, for a process this one starts that uses
    prometheus_client itself (an inference server): it would count into our directory."""
    return {name: value for name, value in env.items() if name != ENV}
