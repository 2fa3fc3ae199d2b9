"""The Ray job's side of the internal API: how a job reports to, and takes work from, the web app.

No Django here (Ray jobs never import it): plain httpx against
``{INTERNAL_API_URL}/internal/v1/runs/{run_id}/...`` with the per-attempt job secret.
``WebReporter`` and ``WebSource`` implement ``rl_core.loop``'s ``Reporter`` and
``TrajectorySource``; ``WebEpisodeSink`` records dataset-mode episodes exactly as
the gateway records agent sessions.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from rl_core.types import Trajectory

logger = logging.getLogger(__name__)

# What a long-poll asks the web app to wait at most (it may wait less: INTERNAL_API_LONG_POLL_S);
# under the client's read timeout.
LONG_POLL_S = 30.0
# How long a call is retried while the web app does not answer (a restart, a database restart);
# past that the job fails and the worker's reconciler restarts it from its last checkpoint.
RETRY_S = 120.0


def job_arguments(description: str, id_flag: str, argv: list[str] | None) -> tuple[str, str, str]:
    """A Ray job's start (the run's and the pool's alike): its id (``--run-id`` or
    ``--pool-id``), the web app's URL and the job secret; logging set up and Ray joined."""
    import argparse
    import os

    import ray

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(id_flag, required=True)
    parser.add_argument("--web-url", required=True, help="Base URL of the web app's internal API.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    secret = os.environ.get("STEEP_JOB_SECRET", "")
    if not secret:
        raise SystemExit("STEEP_JOB_SECRET is not set: the job cannot authenticate to the web app.")
    ray.init(address="auto", logging_level=logging.WARNING)
    return getattr(args, id_flag.removeprefix("--").replace("-", "_")), args.web_url, secret


class InternalAPI:
    def __init__(self, base_url: str, run_id: str, secret: str, *, timeout: float = 60.0):
        self.prefix = f"{base_url.rstrip('/')}/internal/v1/runs/{run_id}"
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {secret}"}, timeout=timeout
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def call(
        self, method: str, name: str, body: dict | None = None, *, retry_s: float = RETRY_S
    ) -> Any:
        """One request, retried on transport errors and 5xx for up to ``retry_s`` seconds: the
        web app may be restarting, or its database (docs/operations.md)."""
        delay, deadline = 0.5, time.monotonic() + retry_s
        while True:
            try:
                response = await self.http.request(method, f"{self.prefix}/{name}", json=body)
            except httpx.TransportError as exc:
                if time.monotonic() + delay > deadline:
                    raise
                logger.warning("internal API %s %s: %r; retrying", method, name, exc)
            else:
                if response.status_code < 500:
                    response.raise_for_status()
                    return (
                        response.json()
                        if response.headers.get("content-type", "").startswith("application/json")
                        else response.content
                    )
                if time.monotonic() + delay > deadline:
                    response.raise_for_status()
                logger.warning(
                    "internal API %s %s answered %d; retrying", method, name, response.status_code
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def config(self) -> dict:
        return await self.call("GET", "config")

    async def dataset_rows(self) -> list[dict]:
        import json

        raw = await self.call("GET", "dataset")
        return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]

    async def status(self, status: str, message: str = "", error: str | None = None) -> str:
        return (
            await self.call(
                "POST", "status", {"status": status, "message": message, "error": error}
            )
        )["status"]

    async def report_cluster(self, resources: dict[str, float]) -> None:
        """The cluster's total GPUs and CPUs, which the web app checks new runs against."""
        await self.call(
            "POST",
            "cluster",
            {"gpus": float(resources.get("GPU", 0)), "cpus": float(resources.get("CPU", 0))},
        )

    async def pool_servers(self, timeout_s: float, poll_s: float = 2.0) -> list[dict]:
        """The servers (``url``, ``backend``) of the shared pool the run attaches to, once it
        has one up; a ``RuntimeError`` saying why when the pool is down or stays empty."""
        return (await self._pool_up("pool", timeout_s, poll_s))["servers"]

    async def teacher_pool(self, timeout_s: float = 120.0, poll_s: float = 2.0) -> dict:
        """The pool that teaches the run (``teacher_pool``), ``{"name", "status", "base_model",
        "servers"}``, once it has a server up (else a ``RuntimeError`` saying why)."""
        return await self._pool_up("teacher_pool", timeout_s, poll_s)

    async def _pool_up(self, endpoint: str, timeout_s: float, poll_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            pool = await self.call("GET", endpoint)
            if pool["servers"]:
                return pool
            if pool["status"] not in ("starting", "running"):
                raise RuntimeError(
                    f"Inference pool '{pool['name']}' is {pool['status']}: an operator must "
                    f"start it (./steep manage pool_scale {pool['name']} N) before the run can."
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Inference pool '{pool['name']}' had no server up within {timeout_s:g} s "
                    "(STEEP_PLACEMENT_TIMEOUT_S)."
                )
            await asyncio.sleep(poll_s)

    def pool_hooks(self, backend: str):
        """``AdapterSync``'s ``refresh`` and ``on_change`` for a run on a shared pool: the
        pool's servers now, and the run's own server list kept in step with them (a server
        is the run's once its current adapter is loaded there)."""

        async def refresh() -> list[str]:
            return [server["url"] for server in (await self.call("GET", "pool"))["servers"]]

        async def on_change(added: list[str], removed: list[str]) -> None:
            for url in added:
                await self.register_server(url, backend)
            for url in removed:
                await self.unregister_server(url)

        return refresh, on_change

    async def register_server(self, url: str, backend: str) -> None:
        await self.call("POST", "servers", {"url": url, "backend": backend})

    async def unregister_server(self, url: str) -> None:
        await self.call("POST", "servers", {"url": url, "action": "unregister"})

    async def hint_signals(self, sessions: dict[str, dict]) -> None:
        """What each session's hint did to its tokens (``rl_core.hints``), for its page."""
        await self.call("POST", "hint_signals", {"sessions": sessions})

    async def release(self) -> int:
        return (await self.call("POST", "release", {}))["released"]

    async def resume(self, *, step: int, version: int) -> dict:
        """The job restored ``step``/``version`` (0/0: none): the web app rewinds the run to it
        and answers ``{"released", "rewound", "accepted", "dropped", "rows_used", "message"}``."""
        return await self.call("POST", "resume", {"step": step, "version": version})

    async def evals(self) -> list[dict]:
        """The run's finished evaluations: ``{"id", "step", "values": {name: number}}``."""
        return (await self.call("GET", "evals"))["evals"]

    async def watch_status(self, unchanged: str, wait_s: float = LONG_POLL_S) -> str:
        """The run's status, once it is not ``unchanged`` or after up to ``wait_s`` (long-poll)."""
        response = await self.call("GET", f"watch?while={unchanged}&wait_s={wait_s:g}")
        return response["status"]


class WebReporter:
    """``rl_core.loop.Reporter`` over the internal API."""

    def __init__(self, api: InternalAPI):
        self.api = api

    async def metrics(self, step: int, version: int, values: dict[str, float]) -> None:
        await self.api.call(
            "POST", "metrics", {"step": step, "version": version, "metrics": values}
        )

    async def version(self, v: int) -> None:
        await self.api.call("POST", "version", {"version": v})

    async def checkpoint(self, version: int, step: int, path: str, size_bytes: int) -> None:
        await self.api.call(
            "POST",
            "checkpoints",
            {"version": version, "step": step, "path": path, "size_bytes": size_bytes},
        )

    async def event(self, kind: str, message: str) -> None:
        await self.api.call("POST", "events", {"kind": kind, "message": message})


class WebSource:
    """``rl_core.loop.TrajectorySource``: claims ready sessions (gateway or rollout driver) for training.

    A session can yield several trajectories (turns rendered afresh start a new one);
    its key is ``session_id#index`` and the session counts as trained when any of its
    trajectories is trained.

    Claims long-poll: the web app holds an empty claim up to ``wait_s`` until a trajectory
    is ready, so an idle run asks a few times a minute. An empty answer that comes back
    sooner than ``poll_s`` (a web app that does not wait) is asked again after a backoff
    that doubles up to ``max_backoff_s``.
    """

    def __init__(
        self,
        api: InternalAPI,
        *,
        wait_s: float = LONG_POLL_S,
        poll_s: float = 0.5,
        max_backoff_s: float = 5.0,
    ):
        self.api = api
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.max_backoff_s = max_backoff_s
        self.buffer: list[tuple[str, Trajectory]] = []
        self.stopped = False
        # Told how many submitted episodes will never be rewarded (judge/human runs): the
        # dataset-mode staleness controller's ``on_unrewarded``, which frees their slots.
        self.on_unrewarded: Callable[[int], None] | None = None

    async def next_batch(self, n: int) -> list[tuple[str, Trajectory]]:
        backoff = self.poll_s
        while len(self.buffer) < n and not self.stopped:
            asked = time.monotonic()
            # One id per claim, the same in call()'s retries: a claim whose answer was lost
            # (the web app restarted) is answered again with what it took.
            claimed = await self.api.call(
                "POST",
                "claim",
                {
                    "limit": n - len(self.buffer),
                    "wait_s": self.wait_s,
                    "claim_id": uuid.uuid4().hex,
                },
            )
            if claimed.get("unrewarded") and self.on_unrewarded is not None:
                self.on_unrewarded(int(claimed["unrewarded"]))
            for item in claimed["sessions"]:
                for index, data in enumerate(item["trajectories"]):
                    self.buffer.append(
                        (f"{item['session_id']}#{index}", Trajectory.from_dict(data))
                    )
            if claimed["sessions"]:
                backoff = self.poll_s
            elif time.monotonic() - asked < self.poll_s:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
        batch, self.buffer = self.buffer[:n], self.buffer[n:]
        return batch

    async def finished(self, trained: list[str], dropped: list[str], version: int) -> None:
        trained_sessions = sorted({key.split("#")[0] for key in trained})
        dropped_sessions = sorted({key.split("#")[0] for key in dropped} - set(trained_sessions))
        await self.api.call(
            "POST",
            "trained",
            {"version": version, "trained": trained_sessions, "dropped": dropped_sessions},
        )

    def stop(self) -> None:
        self.stopped = True


class WebEpisodeSink:
    """The rollout driver's sink: record a finished group as ready sessions in the web app."""

    def __init__(self, api: InternalAPI):
        self.api = api

    async def __call__(self, episodes: list) -> None:
        await self.api.call(
            "POST", "episodes", {"episodes": [episode.to_dict() for episode in episodes]}
        )
