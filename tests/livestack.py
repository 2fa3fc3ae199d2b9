"""Steep's own processes, started for real on 127.0.0.1: the harness of the live tests
(``tests/e2e``, ``tests/gateway``, ``tests/browser``) and of the benchmarks (``bench/``).

    env = steep_env(data_dir=data_dir, database_url=url, site_url=site, local_ray=True)
    with LiveStack(env=env, log_dir=logs) as stack:
        web = stack.start_web(port)
        stack.start_worker()
        stack.wait_ready(web, lambda: answers(f"{site}/login/"), what="the web server")
        ...

Each process runs in its own session (process group) with its output in
``log_dir/NAME.log``. ``stop()`` ends every group by its leader's PID (SIGTERM, then
SIGKILL), so uvicorn's workers and Celery's beat go with their parent, then takes down
the local Ray head a Celery worker started and the runs' folders it wrote: nothing is
left behind. A process that exits while it is awaited fails the wait with its log tail.
A benchmark that wants a whole instance (migrated, a project key, the web server and a
worker up) takes ``bench_instance(name)``.

Why here: this is harness code, not product code, so it stays out of the installed
packages (webapp/, rl_core/, workers/); it lives beside the tests, its main users, and
the bench scripts import it as they import the rest of the repository, with the
repository root on ``sys.path``. It needs only the standard library (no pytest, no
Django, no httpx), so a benchmark that imports it pulls in nothing it does not need.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.inference.process import free_port as free_port  # re-exported for the tests
from rl_core.inference.process import free_ports

ROOT = Path(__file__).resolve().parents[1]

# What a Steep process must not inherit from the caller: it gets the database and Redis it
# is given (or the embedded defaults), never the developer's own.
_SERVICE_VARIABLES = ("DATABASE_URL", "DATABASE_URL_FILE", "REDIS_URL", "REDIS_URL_FILE")

_STOP_LOCAL_RAY = (
    "import os; from pathlib import Path; from workers.ray_cluster import stop_local_cluster; "
    "stop_local_cluster(data_dir=Path(os.environ['DATA_DIR']))"
)

# Straight to 127.0.0.1, whatever HTTP(S)_PROXY says.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StackError(RuntimeError):
    """A process of the stack did not come up (its log tail is in the message)."""


def wait_for(check: Callable[[], Any], timeout: float, what: str, *, interval: float = 0.5):
    """Poll ``check()`` until it returns something truthy and return that; after ``timeout``
    seconds, ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def answers(
    url: str,
    status: int = 200,
    *,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 5.0,
) -> bool:
    """Whether ``url`` answers ``status`` to a GET (a JSON POST when ``body`` is given)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with _DIRECT.open(request, timeout=timeout) as response:
            return response.status == status
    except urllib.error.HTTPError as exc:
        return exc.code == status
    except OSError:  # refused, reset, timed out: not up yet
        return False


def run_checked(
    command: Sequence[str], *, what: str, env: dict[str, str] | None = None, timeout=None
) -> str:
    """Run ``command`` in the repository root and return its stdout; ``StackError`` with its
    output when it fails."""
    result = subprocess.run(
        list(command), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise StackError(f"{what} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def steep_env(
    *,
    data_dir: str | Path,
    database_url: str = "",
    redis_url: str = "",
    site_url: str = "",
    local_ray: bool = False,
    **extra: str,
) -> dict[str, str]:
    """The environment of a Steep process: this one's, on ``data_dir``, with the given
    database and Redis (the embedded SQLite / broker when empty) and ``extra`` on top.

    ``local_ray``: the worker starts its own Ray head on free ports with 8 logical CPUs (three runs: a trainer worker and a torch engine each, with room) (one torch
    thread per process), never an external ``RAY_ADDRESS``.
    """
    env = {k: v for k, v in os.environ.items() if k not in _SERVICE_VARIABLES}
    env.update(
        DJANGO_SETTINGS_MODULE="webapp.settings",
        DATA_DIR=str(data_dir),
        PYTHONUNBUFFERED="1",
    )
    if database_url:
        env["DATABASE_URL"] = database_url
    if redis_url:
        env["REDIS_URL"] = redis_url
    if site_url:
        env["SITE_URL"] = site_url
    if local_ray:
        env.pop("RAY_ADDRESS", None)
        # Distinct from each other and from the web server's (ports asked for one at a time
        # may come back the same).
        web = {int(port) for port in [extra.get("STEEP_PORT")] if port}
        dashboard, gcs = free_ports(2, besides=web)
        env.update(
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
            RAY_LOCAL_DASHBOARD_PORT=str(dashboard),
            RAY_LOCAL_GCS_PORT=str(gcs),
            RAY_NUM_CPUS="8",
            STEEP_TORCH_THREADS="1",
        )
    env.update(extra)
    return env


class LiveStack:
    """Processes started in their own process groups, with their logs; ``stop()`` (or leaving
    the ``with`` block) ends them all.

    ``env`` is the default environment of what it starts (``steep_env(...)``; None: this
    process's own); ``python`` the interpreter that runs uvicorn, Celery and manage.py.
    """

    def __init__(
        self,
        *,
        log_dir: Path,
        env: dict[str, str] | None = None,
        python: str | Path = sys.executable,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.python = str(python)
        self.logs: dict[str, Path] = {}
        self._procs: list[subprocess.Popen] = []
        self._ray_data_dirs: list[str] = []  # where a worker may have started a local Ray head

    def __enter__(self) -> LiveStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- starting

    def start(
        self,
        name: str,
        command: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen:
        """Start ``command`` in its own session, its output in ``log_dir/NAME.log``."""
        log = self.log_dir / f"{name}.log"
        self.logs[name] = log
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                list(command),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env if env is not None else self.env,
                cwd=cwd or ROOT,
                start_new_session=True,  # one group: its children stop with it
            )
        proc.name = name  # type: ignore[attr-defined]
        self._procs.append(proc)
        return proc

    def start_web(
        self,
        port: int,
        *,
        name: str = "web",
        workers: int | None = None,
        access_log: bool = True,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """uvicorn serving ``webapp.asgi`` on 127.0.0.1:``port`` (as ``./steep web`` does)."""
        command = [
            self.python, "-m", "uvicorn", "webapp.asgi:application",
            "--host", "127.0.0.1", "--port", str(port),
            "--lifespan", "off", "--log-level", "warning",
        ]  # fmt: skip
        if workers:
            command += ["--workers", str(workers)]
        if not access_log:
            command.append("--no-access-log")
        return self.start(name, command, env=env)

    def start_worker(
        self, *, name: str = "worker", log_level: str = "info", env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """A Celery worker with beat (threads, 4 at a time); without ``RAY_ADDRESS`` it starts
        a local Ray head for the runs it launches, which ``stop()`` takes down."""
        env = env if env is not None else self.env
        command = [
            self.python, "-m", "celery", "-A", "workers", "worker", "-B",
            "--pool=threads", "--concurrency=4", "-l", log_level,
            "--schedule", str(self.log_dir / f"{name}-beat-schedule"),
        ]  # fmt: skip
        proc = self.start(name, command, env=env)
        settings = env if env is not None else os.environ
        if not settings.get("RAY_ADDRESS") and "DATA_DIR" in settings:
            self._ray_data_dirs.append(settings["DATA_DIR"])
        return proc

    def manage(self, *args: str, env: dict[str, str] | None = None, timeout=600) -> str:
        """``manage.py ARGS`` with the stack's environment; its stdout."""
        return run_checked(
            [self.python, "manage.py", *args],
            env=env if env is not None else self.env,
            what=f"manage.py {' '.join(args[:1])}",
            timeout=timeout,
        )

    def wait_ready(
        self,
        proc: subprocess.Popen,
        check: Callable[[], Any],
        *,
        what: str,
        timeout: float = 60.0,
    ) -> None:
        """Poll ``check()`` until it is truthy; ``StackError`` with the logs if ``proc`` exits
        first or ``timeout`` seconds pass."""

        def ready() -> Any:
            if proc.poll() is not None:
                raise StackError(f"{what} exited ({proc.returncode}):\n{self.log_tail()}")
            return check()

        try:
            wait_for(ready, timeout, what, interval=0.1)
        except TimeoutError as exc:
            raise StackError(f"{exc}:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of every log, each under its file name."""
        out = []
        for path in self.logs.values():
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    # --- stopping

    def stop(self, *procs: subprocess.Popen, timeout: float = 20.0) -> None:
        """End these processes' groups: SIGTERM, SIGKILL to what is left after ``timeout``
        seconds. With none named, all of them, then the local Ray head a worker started and
        the runs' folders under its DATA_DIR."""
        targets = list(procs) or list(reversed(self._procs))
        for proc in targets:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in targets:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(5)
            _signal_group(proc, signal.SIGKILL)  # the leader is gone; what it left in its group
            if proc in self._procs:
                self._procs.remove(proc)
        if not procs:
            for data_dir in self._ray_data_dirs:
                self._stop_local_ray(data_dir)
            self._ray_data_dirs.clear()

    def _stop_local_ray(self, data_dir: str) -> None:
        env = dict(self.env if self.env is not None else os.environ, DATA_DIR=data_dir)
        env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # In a child, as `./steep` does: stopping the head sets Ray's auth variables in the
        # environment of whoever does it.
        try:
            run_checked(
                [self.python, "-c", _STOP_LOCAL_RAY], env=env, what="stopping the local Ray head"
            )
        finally:
            shutil.rmtree(Path(data_dir) / "runs", ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group's id is the leader's PID (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(frozen=True)
class Instance:
    """A benchmark's whole Steep instance (``bench_instance``): its stack, folders, address
    and one project key."""

    stack: LiveStack
    work: Path  # logs, and the instance's data under data/
    data_dir: Path
    url: str
    key: str

    def rest(self, timeout: float = 30.0):
        """An ``httpx.Client`` on the REST API with the project key (httpx is imported here:
        only the benchmarks that ask for a client need it)."""
        import httpx

        return httpx.Client(
            base_url=f"{self.url}/api/v1",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=timeout,
        )


@contextmanager
def bench_instance(
    name: str, *, worker: bool = True, access_log: bool = True, **extra: str
) -> Iterator[Instance]:
    """A fresh instance under ``.steep/bench/NAME-<time>``: migrated, one project's API key,
    the web server answering that key (and, with ``worker``, a Celery worker that starts its
    own local Ray head), everything stopped on leaving the block. ``extra`` goes into
    ``steep_env`` over the defaults (DEBUG on, a random SECRET_KEY)."""
    work = ROOT / ".steep" / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    data_dir = work / "data"
    data_dir.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = {"DEBUG": "true", "SECRET_KEY": secrets.token_urlsafe(32)} | extra
    env = steep_env(data_dir=data_dir, site_url=url, local_ray=worker, **settings)
    with LiveStack(env=env, log_dir=work) as stack:
        stack.manage("migrate", "--noinput", "-v0")
        key = stack.manage("create_api_key", "--project", "bench").strip().splitlines()[-1]
        web = stack.start_web(port, access_log=access_log)
        if worker:
            stack.start_worker(log_level="warning")
        probe = f"{url}/api/v1/project/"
        auth = {"Authorization": f"Bearer {key}"}
        stack.wait_ready(web, lambda: answers(probe, headers=auth), what="the web server")
        yield Instance(stack=stack, work=work, data_dir=data_dir, url=url, key=key)
