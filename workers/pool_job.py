"""A shared inference pool as a Ray job: ``python -m workers.pool_job --pool-id ID --web-url URL``.

Submitted by the Celery worker (``webapp.pools.launching``) with the pool's job secret in
``STEEP_JOB_SECRET``; like a run's job it never imports Django and talks to the web app
over the internal API (``/internal/v1/pools/<id>/...``).

The job keeps ``replicas`` servers of the pool's base model up, each a Ray actor in a
placement group of its own (``workers.replicas.PooledReplica``), serving LoRA adapters
(SGLang's flags: ``--max-lora-rank``, ``--lora-target-modules``, ``--max-loras-per-batch``).
It registers each server once healthy, then long-polls ``watch`` and starts or stops
servers when an operator scales the pool, until the pool is stopped. After each answer it
gives the torch engine servers the runs' fair-share weights (``Pool.run_weights``:
``POST /set_fair_share_weights``, Steep's extension; SGLang has no per-run share). Runs attached to the
pool load their adapters on these servers from their own jobs (``workers.ray_job``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import traceback

import httpx
import ray

from workers.capacity import placement_timeout_s, resolve_backend, server_resources
from workers.job_api import LONG_POLL_S, InternalAPI, job_arguments
from workers.replicas import PooledReplica

logger = logging.getLogger("steep.pool")


class PoolAPI(InternalAPI):
    """The internal API of one pool (the run client's retries and error handling)."""

    def __init__(self, base_url: str, pool_id: str, secret: str):
        super().__init__(base_url, "-", secret, timeout=LONG_POLL_S + 30)
        self.prefix = f"{base_url.rstrip('/')}/internal/v1/pools/{pool_id}"

    async def watch(self, replicas: int, status: str) -> tuple[int, str, dict]:
        row = await self.call(
            "GET", f"watch?replicas={replicas}&status={status}&wait_s={LONG_POLL_S:g}"
        )
        return int(row["replicas"]), str(row["status"]), dict(row.get("run_weights") or {})


async def push_fair_share_weights(urls: list[str], weights: dict) -> list[str]:
    """Give each torch engine server the runs' weights; returns the URLs that took them (a
    failure is logged and retried after the next watch answer)."""
    done = []
    async with httpx.AsyncClient(timeout=30) as http:
        for url in urls:
            try:
                response = await http.post(
                    f"{url}/set_fair_share_weights", json={"weights": weights}
                )
                response.raise_for_status()
                done.append(url)
            except httpx.HTTPError as exc:
                logger.warning("could not set fair-share weights on %s: %s", url, exc)
    return done


class PoolServers:
    """The pool's replicas on this cluster, grown and shrunk to the wanted count."""

    def __init__(self, api: PoolAPI, settings: dict, backend: str, cluster: dict):
        self.api, self.backend = api, backend
        tensor_parallel = int(settings.get("tensor_parallel") or 1)
        self.resources = server_resources(backend, cluster, tensor_parallel)
        self.args = (
            backend,
            settings["base_model"],
            {"STEEP_TORCH_THREADS": os.environ.get("STEEP_TORCH_THREADS", "1")},
            os.environ.get("STEEP_PID_DIR", ""),
            {
                "tensor_parallel": tensor_parallel,
                "lora_rank": settings["max_lora_rank"],
                "lora_target_modules": settings["lora_target_modules"],
                # One limit for both: a batch holds at most what is loaded; past it the
                # least recently used idle adapter is evicted (lora.py, torch engine).
                "max_loras_per_batch": settings["max_loaded_adapters"],
                "max_loaded_loras": settings["max_loaded_adapters"],
            },
        )
        self.replicas: list[PooledReplica] = []
        self._weighted: dict[str, dict] = {}  # url → the weights it took

    async def set_weights(self, weights: dict) -> None:
        if self.backend != "torch":
            return
        stale = [r.url for r in self.replicas if r.url and self._weighted.get(r.url) != weights]
        for url in await push_fair_share_weights(stale, weights):
            self._weighted[url] = weights

    async def scale(self, wanted: int) -> None:
        while len(self.replicas) < wanted:
            replica = PooledReplica(self.resources, *self.args)
            self.replicas.append(replica)
            url = await replica.start(placement_timeout_s())
            await self.api.register_server(url, self.backend)
            logger.info("pool server %d up at %s", len(self.replicas), url)
        while len(self.replicas) > wanted:
            replica = self.replicas.pop()
            await self.api.unregister_server(replica.url)  # no new request goes to it first
            await replica.stop()

    async def stop_all(self) -> None:
        for replica in reversed(self.replicas):
            try:
                if replica.url:
                    await self.api.unregister_server(replica.url)
            except Exception:
                logger.exception("could not unregister %s", replica.url)
            await replica.stop()
        self.replicas = []


async def run_pool(pool_id: str, web_url: str, secret: str) -> str:
    api = PoolAPI(web_url, pool_id, secret)
    servers: PoolServers | None = None
    try:
        settings = await api.call("GET", "config")
        cluster = ray.cluster_resources()
        backend = resolve_backend(settings["backend"], cluster)
        servers = PoolServers(api, settings, backend, cluster)
        wanted, status = int(settings["replicas"]), str(settings["status"])
        weights = dict(settings.get("run_weights") or {})
        while status in ("starting", "running"):
            await servers.scale(wanted)
            await servers.set_weights(weights)
            if status == "starting":
                await api.call("POST", "status", {"status": "running"})
            wanted, status, weights = await api.watch(wanted, status)
        await servers.stop_all()
        await api.call("POST", "status", {"status": "stopped"})
        return "stopped"
    except asyncio.CancelledError:  # SIGTERM: Ray stopped the job, or Steep is going down
        raise
    except Exception as exc:
        logger.exception("pool %s failed", pool_id)
        try:
            error = f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()[-4000:]}"
            await api.call("POST", "status", {"status": "failed", "error": error}, retries=1)
        except Exception:
            logger.exception("could not report the failure")
        raise
    finally:
        if servers is not None:
            await servers.stop_all()
        await api.aclose()


def main(argv: list[str] | None = None) -> None:
    pool_id, web_url, secret = job_arguments(
        "Keep one Steep inference pool's servers up.", "--pool-id", argv
    )

    async def serve() -> None:
        task = asyncio.ensure_future(run_pool(pool_id, web_url, secret))
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(serve())


if __name__ == "__main__":
    main()
