"""Inference servers as Ray actors: a run's dedicated replicas and a shared pool's.

``InferenceReplica`` owns one server (the run's or pool's backend: the torch engine, SGLang
or vLLM, ``rl_core.inference.launch``). A run's job starts its replicas with plain actor
resources; a pool's job (``workers.pool_job``) gives each replica a placement group of
its own (``PooledReplica``), so that scaling a pool reserves and frees whole replicas.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_core.inference.launch import free_port, make_inference_server
from rl_core.inference.vllm import vllm_cpu_settings


@ray.remote
class InferenceReplica:
    """One inference server (the torch engine, SGLang or vLLM) owned by a Ray actor."""

    def __init__(
        self,
        backend: str,
        model_path: str,
        env: dict[str, str],
        pid_dir: str = "",
        server_kwargs: dict | None = None,
    ):
        os.environ.update(env)
        host = (
            "127.0.0.1"
            if backend != "sglang" and env.get("STEEP_LOCAL_ONLY", "1") == "1"
            else ray.util.get_node_ip_address()
        )
        kwargs = dict(server_kwargs or {})
        if backend == "vllm" and not ray.get_gpu_ids():  # its CPU build
            kwargs |= vllm_cpu_settings()
        self.server = make_inference_server(
            backend, model_path, host=host, port=free_port(), pid_dir=pid_dir or None, **kwargs
        )
        self.server.start()
        self.server.wait_healthy(timeout=float(env.get("STEEP_SERVER_START_TIMEOUT", "600")))

    def url(self) -> str:
        return self.server.url

    def exit_code(self) -> int | None:
        """None while the server runs, else how it ended (a negative signal number if killed)."""
        process = self.server.process
        return None if process is None else process.poll()

    def restart(self, timeout: float) -> None:
        """Start the server again on the same URL (what every client holds), once it is healthy."""
        self.server.stop()  # what is left of the old one: its group, its record, its log handle
        self.server.start()
        self.server.wait_healthy(timeout=timeout)

    def stop(self) -> None:
        self.server.stop()


def ray_options(resources: dict[str, float]) -> dict:
    return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}


class PooledReplica:
    """A replica in a placement group of its own (one bundle): ``start`` waits for the group
    and the server; ``stop`` stops the server and frees the group."""

    def __init__(self, resources: dict[str, float], *args: Any):
        self.group: Any = placement_group([dict(resources)], strategy="STRICT_PACK")
        self.actor: Any = InferenceReplica.options(
            **ray_options(resources),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=0
            ),
        ).remote(*args)
        self.url = ""

    async def start(self, timeout_s: float) -> str:
        import asyncio

        await asyncio.wait_for(self.group.ready(), timeout_s)
        self.url = await self.actor.url.remote()
        return self.url

    async def stop(self) -> None:
        try:
            await self.actor.stop.remote()
        except Exception:
            pass
        ray.kill(self.actor)
        remove_placement_group(self.group)
