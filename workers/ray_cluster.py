"""The Ray cluster runs use: an existing one (``RAY_ADDRESS``) or a local head Steep starts and reuses.

Used by the Celery worker (no torch here). Token authentication is configured
deliberately: a local head gets a token kept in ``DATA_DIR/ray/auth_token`` and
every client of it (this module, the job) uses it; for an external cluster set
``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` (or ``RAY_AUTH_TOKEN_PATH``) as that cluster requires.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rl_core.inference.process import free_ports, group_alive, signal_group, take_recorded_groups


class RayUnavailable(RuntimeError):
    pass


AGENT_WAIT_S = 60.0
LOCAL_MIN_CPUS = 8  # what a local head offers at least (without RAY_NUM_CPUS)


@dataclass
class RayCluster:
    dashboard_url: str  # what the Jobs API talks to
    local: bool


def _ray_dir(data_dir: Path) -> Path:
    path = data_dir / "ray"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _ray_temp_dir(data_dir: Path) -> Path:
    # Ray puts AF_UNIX sockets under its temp dir, and their paths must stay under 107
    # bytes: a deep DATA_DIR would break the head, so sessions live in a short path.
    digest = hashlib.sha1(str(data_dir.resolve()).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"steep-ray-{digest}"


def configure_local_auth(data_dir: Path) -> None:
    """Point this process's Ray clients at the local head's token (created on first use)."""
    token_path = _ray_dir(data_dir) / "auth_token"
    if not token_path.exists():
        token_path.write_text(secrets.token_hex(32))
        token_path.chmod(0o600)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _jobs_client(url: str):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(url)


def _alive(url: str) -> bool:
    try:
        _jobs_client(url).list_jobs()
    except Exception:
        return False
    return True


def dashboard_url(address: str, *, dashboard_port: int = 8265) -> str:
    """The Jobs API URL of the cluster named by ``RAY_ADDRESS``.

    ``http(s)://host:port`` is used as given (the only form for a dashboard on another
    port or behind a proxy, e.g. KubeRay's ``...-head-svc:8265``); the GCS address
    ``host:6379``, the client address ``ray://host:10001`` or a bare ``host`` become
    ``http://host:<dashboard_port>``; ``auto``/``localhost`` mean this machine.
    """
    if address.startswith(("http://", "https://")):
        return address.rstrip("/")
    host = urlsplit("//" + address.split("://", 1)[-1]).hostname or ""
    if host in ("", "auto", "local", "localhost"):
        host = "127.0.0.1"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"http://{host}:{dashboard_port}"


JOBS_API_WAIT_S = 60.0  # how long a started head's Jobs API has to answer


def ensure_cluster(
    *,
    data_dir: Path,
    address: str = "",
    num_cpus: int | None = None,
    dashboard_port: int = 8265,
    gcs_port: int = 7379,
) -> RayCluster:
    """The configured cluster, or a local head (started now if it is not already running)."""
    if address:
        url = dashboard_url(address, dashboard_port=dashboard_port)
        if not _alive(url):
            raise RayUnavailable(
                f"The Ray cluster at {address} does not answer on its Jobs API ({url})."
            )
        return RayCluster(dashboard_url=url, local=False)

    configure_local_auth(data_dir)
    # One starter at a time: two runs launched together (./steep up's demo runs) would
    # otherwise both start a head, and one of them fails.
    with open(_ray_dir(data_dir) / "start.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_local_head(data_dir, num_cpus, dashboard_port, gcs_port)


def _ensure_local_head(
    data_dir: Path, num_cpus: int | None, dashboard_port: int, gcs_port: int
) -> RayCluster:
    state = _ray_dir(data_dir) / "head.json"
    if state.exists():
        url = json.loads(state.read_text())["dashboard_url"]
        if _alive(url):
            return RayCluster(dashboard_url=url, local=True)
    url = f"http://127.0.0.1:{dashboard_port}"
    agent_port, client_port = free_ports(2, besides={dashboard_port, gcs_port})
    command = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(gcs_port),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dashboard_port),
        # Ports Ray would otherwise take fixed (52365, 10001): another Ray head on this
        # machine holding them leaves this one without its job agent ("No available agent").
        # Two distinct ones: Ray refuses to start with one port for both.
        "--dashboard-agent-listen-port",
        str(agent_port),
        "--ray-client-server-port",
        str(client_port),
        "--num-cpus",
        # Logical CPUs are admission tokens: a run takes one per trainer worker and one per
        # torch engine; the demo starts two runs and a user adds a third: even a 2-core
        # machine offers 8 (the processes share its cores, as they did in one job before).
        str(num_cpus or max(os.cpu_count() or 2, LOCAL_MIN_CPUS)),
        "--disable-usage-stats",
        "--temp-dir",
        str(_ray_temp_dir(data_dir)),
    ]
    # Without the worker's metrics directory (webapp.metrics.multiprocess): Ray's own
    # processes use prometheus_client, and would count into it.
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    # A head that failed is stopped, not left behind: its processes would hold the ports,
    # and with no head.json the next start would try them again.
    if result.returncode != 0 and not _alive(url):
        stop_local_cluster(data_dir=data_dir)
        raise RayUnavailable(
            f"Could not start a local Ray head: {result.stderr[-2000:] or result.stdout[-2000:]}"
        )
    deadline = time.monotonic() + JOBS_API_WAIT_S
    while not _alive(url):
        if time.monotonic() > deadline:
            stop_local_cluster(data_dir=data_dir)
            raise RayUnavailable("The local Ray head started but its Jobs API never answered.")
        time.sleep(0.5)
    state.write_text(json.dumps({"dashboard_url": url}))
    return RayCluster(dashboard_url=url, local=True)


def inference_pid_dir(data_dir: Path) -> Path:
    """Where the runs' inference servers on the local head are recorded while they run
    (``rl_core.inference.process.record_process``)."""
    return Path(data_dir) / "pids" / "inference"


def stop_local_cluster(*, data_dir: Path, grace_s: float = 2.0) -> list[int]:
    """Stop the local head Steep started for ``data_dir`` and the runs' inference servers on
    it, and only those; returns the PIDs signalled.

    The head's processes (GCS, raylet, dashboard, the jobs' drivers) are the ones whose
    command line names its temp dir, which is ``data_dir``'s own (``_ray_temp_dir``), with all
    their descendants (agents, workers). The inference servers run in sessions of their own
    and may have lost their parent: they are the ones recorded in ``inference_pid_dir``.
    Each gets SIGTERM, then SIGKILL after ``grace_s`` (the GCS and the raylet do not stop on
    SIGTERM alone). Unlike ``ray stop --force``, any other Ray work on the machine is left alone.
    """
    marker = str(_ray_temp_dir(data_dir))
    # Their children too (the raylet's agents and workers, the dashboard's modules), taken
    # before any is signalled: an orphan's parent is no longer its parent. And the runs' job
    # drivers, which a head that died (its worker killed) left behind: they name no temp dir,
    # but their environment names this head's token.
    token = f"RAY_AUTH_TOKEN_PATH={_ray_dir(data_dir) / 'auth_token'}"
    roots = set(_pids_naming(marker)) | set(_pids_with_environment(token))
    pids = _with_descendants(sorted(roots - {os.getpid(), os.getppid()}))
    groups = take_recorded_groups(inference_pid_dir(data_dir))
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    groups = [pgid for pgid in groups if signal_group(pgid, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (
        any(_running(pid) for pid in pids) or any(group_alive(pgid) for pgid in groups)
    ):
        time.sleep(0.1)
    for pid in pids:
        if _running(pid):
            _signal(pid, signal.SIGKILL)
    for pgid in groups:
        signal_group(pgid, signal.SIGKILL)
    (_ray_dir(data_dir) / "head.json").unlink(missing_ok=True)
    return pids + [pgid for pgid in groups if pgid not in pids]


def _pids_naming(text: str) -> list[int]:
    """PIDs of this user's processes whose command line contains ``text`` (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            arguments = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if text in arguments:
            pids.append(int(entry.name))
    return pids


def _pids_with_environment(entry: str) -> list[int]:
    """PIDs of this user's processes started with ``entry`` (``NAME=value``) in their environment."""
    wanted = entry.encode()
    pids = []
    for path in Path("/proc").iterdir():
        if not path.name.isdigit():
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            environment = (path / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if wanted in environment:
            pids.append(int(path.name))
    return pids


def _with_descendants(roots: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo += children.get(pid, [])
    return found


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _running(pid: int) -> bool:
    """Alive and not a zombie (a child of ours that exited but was not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def submit_job(
    cluster: RayCluster,
    *,
    submission_id: str,
    entrypoint: list[str],
    env: dict[str, str],
    num_gpus: float = 0,
) -> str:
    """Submit the job; ``num_gpus`` > 0 places its driver (the trainer) on a node with GPUs.

    A head that has just started answers the Jobs API before its job agent is up ("No
    available agent to submit job"): that is retried for up to ``AGENT_WAIT_S``.
    """
    import shlex

    client = _jobs_client(cluster.dashboard_url)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(
                entrypoint=" ".join(shlex.quote(part) for part in entrypoint),
                submission_id=submission_id,
                runtime_env={"env_vars": env},
                entrypoint_num_gpus=num_gpus or None,
            )
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def job_status(cluster: RayCluster, job_id: str) -> str:
    """PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED — or MISSING when the cluster has no such
    job. ``RayUnavailable`` when the cluster does not answer (no telling what became of it)."""
    try:
        return str(_jobs_client(cluster.dashboard_url).get_job_status(job_id).value)
    except RuntimeError:
        return "MISSING"
    except OSError as exc:  # requests' ConnectionError, a timeout
        raise RayUnavailable(
            f"The Ray cluster at {cluster.dashboard_url} does not answer: {exc}"
        ) from exc


def job_logs_tail(cluster: RayCluster, job_id: str, lines: int = 60) -> str:
    try:
        logs = _jobs_client(cluster.dashboard_url).get_job_logs(job_id)
    except Exception as exc:  # the log tail is a courtesy; never fail because of it
        return f"(logs unavailable: {exc})"
    return "\n".join(logs.splitlines()[-lines:])


def stop_job(cluster: RayCluster, job_id: str) -> None:
    """Ask Ray to stop the job; nothing to do when it is gone, or its cluster with it."""
    try:
        _jobs_client(cluster.dashboard_url).stop_job(job_id)
    except (RuntimeError, OSError):
        pass
