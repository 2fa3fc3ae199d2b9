"""One inference server as a subprocess: the interface every backend's launcher implements.

``InferenceServer`` starts the server's command line in its own process group,
waits for ``GET /health``, and stops the whole group. A backend says only how its
server is started (``command``, ``environment``); the backends and the choice
between them live in ``rl_core.inference.launch``.

A server runs in its own session, so nothing that signals its parent's process group
reaches it. Given a ``pid_dir``, it is recorded there while it runs (``record_process``)
so that whoever owns that directory can stop every server still running, by PID, even
after their parents died without stopping them (``take_recorded_groups``, then
``signal_group``; ``./steep up`` does at Ctrl-C, in ``workers.ray_cluster``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO

import httpx

logger = logging.getLogger(__name__)


def when_parent_exits(parent: int, then: Callable[[], None], every_s: float = 1.0) -> None:
    """Call ``then`` (from a daemon thread) once ``parent`` is no longer this process's
    parent: a child its owner started, left running after the owner was killed, ends too."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        then()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ServerStartError(RuntimeError):
    """An inference server exited or did not become healthy; the message ends with its log tail."""


def _start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot, from /proc): with the PID, it names
    one process, not a later one given the same PID. None when there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def record_process(pid_dir: str | os.PathLike[str], pid: int, **info: str) -> Path:
    """Record the process group led by ``pid`` in ``pid_dir/<pid>.json`` (with ``info``)."""
    path = Path(pid_dir) / f"{pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "start_time": _start_time(pid), **info}))
    return path


def take_recorded_groups(pid_dir: str | os.PathLike[str]) -> list[int]:
    """The process groups recorded in ``pid_dir`` that may still run, to be stopped
    (``signal_group``); their records are removed.

    A recorded PID that now names another process (its start time differs) is left out.
    One that names no process any more may still lead a group (a server's children outlive
    it): it is kept, as Linux gives no new process a PID still used as a group id.
    """
    groups = []
    for path in sorted(Path(pid_dir).glob("*.json")):
        try:
            record = json.loads(path.read_text())
            pid = int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not a record of ours
        else:
            started = _start_time(pid)
            if started is None or started == record.get("start_time"):
                groups.append(pid)
        path.unlink(missing_ok=True)
    return groups


def signal_group(pgid: int, number: int) -> bool:
    """Send signal ``number`` to process group ``pgid``; False when there is no such group."""
    try:
        os.killpg(pgid, number)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def group_alive(pgid: int) -> bool:
    """Some process of the group is alive and not a zombie (from /proc)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1", *, besides: Collection[int] = ()) -> list[int]:
    """``count`` distinct TCP ports free right now on ``host``, none of ``besides``.

    All are held bound until all are chosen: ports asked for one at a time may come back
    the same (the OS hands a released port out again), and a Ray head given one port for
    two of its components refuses to start.
    """
    sockets: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in besides:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()


class InferenceServer(ABC):
    """One inference server subprocess: ``start()``, ``wait_healthy()``, ``url``, ``stop()``.

    The process runs in its own session (process group) so ``stop()`` also ends any
    children it spawned (SGLang starts scheduler and detokenizer processes). Its
    stdout/stderr go to ``log_path`` (a temp file unless given). With ``pid_dir`` it is
    recorded there from ``start()`` to ``stop()`` (``record_process``).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        weight_version: int | str = 0,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
        pid_dir: str | os.PathLike[str] | None = None,
    ):
        self.model_path = str(model_path)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.weight_version = str(weight_version)
        self.env = dict(env or {})
        self.extra_args = list(extra_args or [])
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(tempfile.mkstemp(prefix=f"steep-{self.backend}-", suffix=".log")[1])
        )
        self.pid_dir = Path(pid_dir) if pid_dir else None
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._pid_file: Path | None = None

    backend: str = ""

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:30000``."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @abstractmethod
    def command(self) -> list[str]:
        """The argv that starts the server."""

    def environment(self) -> dict[str, str]:
        """The environment the server runs with (this process's plus ``env``)."""
        return {**os.environ, **self.env}

    def start(self) -> InferenceServer:
        """Start the subprocess (returns at once; see ``wait_healthy``)."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"{self.backend} server on {self.url} is already running")
        cmd = self.command()
        logger.info("starting %s server: %s (log: %s)", self.backend, " ".join(cmd), self.log_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        if self.pid_dir is not None:
            self._pid_file = record_process(
                self.pid_dir, self.process.pid, backend=self.backend, url=self.url
            )
        return self

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The end of the server's log, for error messages."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")

    def wait_healthy(self, timeout: float = 300.0, *, interval: float = 0.25) -> None:
        """Block until ``GET /health`` answers 200; raise ``ServerStartError`` if it exits or times out."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=httpx.Timeout(5.0, read=30.0)) as http:
            while True:
                if self.process is None:
                    raise ServerStartError("the server was never started")
                code = self.process.poll()
                if code is not None:
                    raise ServerStartError(
                        f"{self.backend} server exited with code {code}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(self.url + "/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.backend} server on {self.url} not healthy after {timeout:.0f}s:\n{self.log_tail()}"
                    )
                time.sleep(interval)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout`` s; idempotent."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self._pid_file is not None:
            self._pid_file.unlink(missing_ok=True)
            self._pid_file = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> InferenceServer:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} model={self.model_path!r}>"
