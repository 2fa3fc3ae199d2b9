"""The trainer as Ray actors: ``train_workers`` processes, one ``PPOTrainer`` each.

``TrainerGroup`` lives in the job's driver and is what ``rl_core.loop.TrainingLoop``
calls (the loop's ``Trainer`` protocol). It reserves one bundle per worker (a GPU and a
CPU on a GPU cluster, a CPU otherwise) in a placement group with strategy PACK, so the
workers share as few nodes as possible, and gives up after ``placement_timeout_s`` with
a message naming what it waited for. Above one worker the actors join one
``torch.distributed`` group (NCCL on GPUs, gloo on CPUs) whose rendezvous is rank 0's
node IP and a free port there; ``PPOTrainer`` then shards the model with FSDP2.

Every call goes to every actor with the same arguments (the batch is put in the object
store once): each rank trains its token-balanced shard of it and every rank joins the
saves' collectives, while rank 0 alone writes files and reports stats. One worker is an
actor too, so the trainer gets a GPU of the cluster even when the driver runs on a node
without one.

Files: rank 0 writes weights and checkpoints under the run's ``DATA_DIR`` folder and the
driver then writes beside them, so on more than one node ``DATA_DIR`` must be one shared
filesystem (docs/deploy.md). Loading a checkpoint reads it on rank 0 only.

If any actor fails (an exception, a crashed process), the others may be blocked in a
collective that will never complete: the group kills every actor and re-raises. A worker
killed inside a collective breaks the others' collective at once; their error may arrive
before Ray reports the death, so the group looks for the death first and raises that (the
job restarts a run after a crash, and fails it after an error).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_core.config import RunConfig
from rl_core.inference.process import free_port
from rl_core.types import Trajectory
from workers.capacity import CapacityError

logger = logging.getLogger(__name__)

# How long a collective may block before torch.distributed gives up on a silent peer.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
# How long a failed call looks for a peer's death behind its error (_peer_death).
PEER_DEATH_WAIT_S = 15.0


# The "checkpoint" group has its own thread: a snapshot's disk write runs beside the next
# train_step, while every other call still runs one at a time (Ray's concurrency groups).
@ray.remote(concurrency_groups={"checkpoint": 1})
class TrainerWorker:
    """One trainer process: rank ``rank`` of ``world_size``."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str]):
        os.environ.update(env)
        self.rank, self.world_size = rank, world_size
        self.trainer: Any = None
        self._snapshot: Any = None  # a checkpoint copied, waiting to be written

    def rendezvous(self) -> tuple[str, int]:
        """Where the others find rank 0: this node's IP and a port free on it now."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def start(self, config: dict[str, Any], host: str, port: int) -> int:
        """Join the process group (above one worker) and build the trainer; its version."""
        import torch
        import torch.distributed as dist

        from rl_core.trainer import PPOTrainer

        if not torch.cuda.is_available():
            torch.set_num_threads(int(os.environ.get("STEEP_TORCH_THREADS", "1")))
        # cpu_offload shards with FSDP2 also for one worker: a group of one.
        if self.world_size > 1 or config.get("cpu_offload"):
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(0)  # Ray shows each worker its own GPU as device 0
            dist.init_process_group(
                backend,
                init_method=f"tcp://{host}:{port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=COLLECTIVE_TIMEOUT,
            )
        self.trainer = PPOTrainer(RunConfig.from_dict(config))
        return self.trainer.version

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float] | None:
        stats = self.trainer.train_step(trajectories)
        return stats if self.rank == 0 else None

    def save_weights(self, path: str) -> str:
        return self.trainer.save_weights(path)

    def save_adapter(self, path: str, role: str = "") -> str:
        return self.trainer.save_adapter(path, role)

    def save_checkpoint(self, path: str) -> str:
        return self.trainer.save_checkpoint(path)

    def checkpoint_snapshot(self) -> bool:
        """Copy the state a checkpoint holds (``PPOTrainer.checkpoint_snapshot``); False where
        the trainer saves in step only (several workers)."""
        self._snapshot = self.trainer.checkpoint_snapshot()
        return self._snapshot is not None

    @ray.method(concurrency_group="checkpoint")
    def write_checkpoint_snapshot(self, path: str) -> str:
        write, self._snapshot = self._snapshot, None
        if write is None:
            raise RuntimeError("no checkpoint snapshot to write")
        return write(path)

    def load_checkpoint(self, path: str) -> int:
        self.trainer.load_checkpoint(path)
        return self.trainer.version

    # Distributed weight updates (rl_core.weight_sync): a failure is returned, never
    # raised, so that TrainerGroup does not take it for a dead worker.

    def weight_metadata(self) -> dict[str, list]:
        return self.trainer.weight_metadata()

    def init_weight_group(self, kwargs: dict[str, Any]) -> str | None:
        try:
            self.trainer.init_weight_group(**kwargs)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def broadcast_weights(self, group_name: str) -> dict[str, Any] | None:
        result = self.trainer.broadcast_weights(group_name)
        return result if self.rank == 0 else None

    def destroy_weight_group(self, group_name: str) -> None:
        self.trainer.destroy_weight_group(group_name)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """``config.train_workers`` trainer actors behind the loop's ``Trainer`` protocol.

    Blocking (``ray.get``): the loop calls it in a thread. ``close()`` ends the actors
    and frees their placement group; call it when the run ends.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        bundle: dict[str, float],
        placement_timeout_s: float,
        env: dict[str, str] | None = None,
    ):
        n = config.train_workers
        self._actors: list[Any] = []
        self._pg: Any = placement_group([dict(bundle)] * n, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=placement_timeout_s)
        except GetTimeoutError:
            remove_placement_group(self._pg)
            wanted = ", ".join(f"{v:g} {k}" for k, v in sorted(bundle.items()))
            raise CapacityError(
                f"Ray could not place train_workers={n} trainer workers ({wanted} each, "
                f"packed onto as few nodes as possible) within {placement_timeout_s:g} s: "
                f"the cluster has {_totals()} in all, and other work may hold some of it. "
                "Lower train_workers, free or add resources, or raise STEEP_PLACEMENT_TIMEOUT_S."
            ) from None
        self._actors = [
            TrainerWorker.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=rank
                ),
            ).remote(rank, n, dict(env or {}))
            for rank in range(n)
        ]
        try:
            host, port = ray.get(self._actors[0].rendezvous.remote())
            self.version: int = self._call("start", config.to_dict(), host, port)
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every actor; rank 0's result. The first failure ends them all."""
        self._rank0(method)
        refs = [getattr(actor, method).remote(*args) for actor in self._actors]
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done[0])  # raises the actor's error at once, not after the others
        except Exception as exc:
            logger.error("trainer worker failed in %s; stopping all %d", method, len(refs))
            death = None if _died(exc) else _peer_death(pending)
            self.close(graceful=False)
            if death is not None:
                raise death from exc
            raise
        except BaseException:
            self.close(graceful=False)
            raise
        return ray.get(refs[0])

    def _rank0(self, method: str) -> Any:
        if not self._actors:  # closed, or stopped after a worker failed
            raise RuntimeError(f"the trainer workers were stopped; cannot call {method}")
        return self._actors[0]

    # The loop's Trainer protocol.

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        stats = self._call("train_step", ray.put(list(trajectories)))
        self.version = int(stats["version"])
        return stats

    def save_weights(self, path: str) -> str:
        return self._call("save_weights", str(path))

    def save_adapter(self, path: str, role: str = "") -> str:
        return self._call("save_adapter", str(path), role)

    def save_checkpoint(self, path: str) -> str:
        return self._call("save_checkpoint", str(path))

    def checkpoint_snapshot(self) -> Callable[[str], str] | None:
        """The loop's asynchronous checkpoint: the workers copy their state now; the returned
        function has rank 0 write it in its checkpoint thread while the next steps train.
        ``None`` above one worker (a sharded save is a collective: it saves in step)."""
        if not self._call("checkpoint_snapshot"):
            return None
        writer = self._rank0("write_checkpoint_snapshot")
        return lambda path: ray.get(writer.write_checkpoint_snapshot.remote(str(path)))

    def load_checkpoint(self, path: str) -> None:
        self.version = self._call("load_checkpoint", str(path))

    # Distributed weight updates: rank 0 hosts the group; every rank gathers for the broadcast.

    def weight_group_address(self) -> tuple[str, int]:
        return tuple(ray.get(self._rank0("rendezvous").rendezvous.remote()))  # type: ignore[return-value]

    def weight_metadata(self) -> dict[str, list]:
        return ray.get(self._rank0("weight_metadata").weight_metadata.remote())

    def init_weight_group(self, **kwargs: Any) -> None:
        error = ray.get(self._rank0("init_weight_group").init_weight_group.remote(kwargs))
        if error:
            raise RuntimeError(error)

    def broadcast_weights(self, group_name: str) -> dict[str, Any]:
        return self._call("broadcast_weights", group_name)

    def destroy_weight_group(self, group_name: str) -> None:
        ray.get(self._rank0("destroy_weight_group").destroy_weight_group.remote(group_name))

    def close(self, *, graceful: bool = True) -> None:
        """End the actors (after leaving their process group when ``graceful``) and free the GPUs."""
        actors, self._actors = self._actors, []
        if graceful and actors:
            try:
                ray.get([actor.close.remote() for actor in actors], timeout=30)
            except Exception:
                logger.warning("trainer workers did not close cleanly; killing them")
        for actor in actors:
            ray.kill(actor)
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def _died(exc: BaseException) -> bool:
    return isinstance(exc, ray.exceptions.RayActorError) and not exc.actor_init_failed


def _peer_death(pending: list[Any]) -> BaseException | None:
    """A peer's death behind a survivor's error, if Ray reports one within ``PEER_DEATH_WAIT_S``.

    When one worker is killed inside a collective, the others' collective breaks at once (gloo:
    "Connection closed by peer") and their error can reach the driver before Ray has noticed
    the dead process. The job tells a crash (restart from the last checkpoint) from a failure
    (the run fails with its message) by the error it gets, so the death is looked for first."""
    deadline = time.monotonic() + PEER_DEATH_WAIT_S
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:
                if _died(exc):
                    return exc
    return None


def _totals() -> str:
    resources = ray.cluster_resources()
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in ("GPU", "CPU"))
