"""Start, health-check and stop inference servers as subprocesses, whatever the backend.

A run's Ray job starts one server per replica with ``make_inference_server(...)``
and hands each ``server.url`` to an ``InferenceClient``. Both backends speak
SGLang's native HTTP API, so nothing above this module knows which one runs:

    server = make_inference_server("auto", model_path, port=free_port(), weight_version=0)
    with server:                      # start() + wait_healthy(); stop() on exit
        ...  # InferenceClient(server.url)

``auto`` picks SGLang when it is installed and a CUDA GPU is visible, otherwise
the torch engine. This module imports neither torch nor sglang at import time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any

import httpx

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "sglang")


class ServerStartError(RuntimeError):
    """An inference server exited or did not become healthy; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class InferenceServer(ABC):
    """One inference server subprocess: ``start()``, ``wait_healthy()``, ``url``, ``stop()``.

    The process runs in its own session (process group) so ``stop()`` also ends any
    children it spawned (SGLang starts scheduler and detokenizer processes). Its
    stdout/stderr go to ``log_path`` (a temp file unless given).
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
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

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


class TorchEngineServer(InferenceServer):
    """``python -m rl_core.inference.torch_engine`` (CPU, or one GPU without SGLang)."""

    backend = "torch"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        max_running_requests: int = 32,
        num_threads: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        context_length: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(model_path, **kwargs)
        self.max_running_requests = max_running_requests
        self.num_threads = num_threads
        self.dtype = dtype
        self.device = device
        self.context_length = context_length

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "rl_core.inference.torch_engine",
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--weight-version", self.weight_version,
            "--max-running-requests", str(self.max_running_requests),
            "--dtype", self.dtype,
            "--device", self.device,
        ]  # fmt: skip
        if self.num_threads:
            cmd += ["--num-threads", str(self.num_threads)]
        if self.context_length:
            cmd += ["--context-length", str(self.context_length)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = super().environment()
        # The engine must import rl_core even when the caller runs from elsewhere.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return env


def sglang_available() -> bool:
    """True when ``import sglang`` works and torch sees a CUDA GPU."""
    try:
        import sglang  # noqa: F401
        import torch
    except Exception:
        return False
    return bool(torch.cuda.is_available())


def choose_backend(backend: str = "auto") -> str:
    """Resolve ``auto`` to ``sglang`` (installed + CUDA) or ``torch``; check explicit choices."""
    if backend not in BACKENDS:
        raise ValueError(f"inference backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "sglang" if sglang_available() else "torch"
    if backend == "sglang" and not sglang_available():
        raise ValueError(
            "inference_backend is 'sglang' but sglang is not installed or no CUDA GPU is visible; "
            "install steep[gpu] on a GPU machine, or set inference_backend to 'torch' or 'auto'."
        )
    return backend


def make_inference_server(
    backend: str, model_path: str | os.PathLike[str], **kwargs: Any
) -> InferenceServer:
    """An (unstarted) server for ``backend`` (``auto``/``torch``/``sglang``); kwargs go to its class."""
    chosen = choose_backend(backend)
    if chosen == "sglang":
        from rl_core.inference.sglang import SGLangServer

        return SGLangServer(model_path, **kwargs)
    return TorchEngineServer(model_path, **kwargs)
