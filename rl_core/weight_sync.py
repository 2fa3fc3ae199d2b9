"""Publish a trainer's weights to every inference server after each step, stalling generation only for the swap.

Two strategies (the run setting ``weight_sync``):

``distributed`` (SGLang's protocol): once, the trainer's rank 0 hosts a process group of
its own (``rl_core.inference.weight_group``) and every server joins it
(``POST /init_weights_update_group``, run concurrently with the trainer's join). Per
update, ``POST /update_weights_from_distributed`` (names, dtypes, shapes, weight version)
goes to every server while the trainer broadcasts the tensors in that order; both run
concurrently, since each broadcast needs every member.

``disk``: ``save_weights`` to ``weights_dir/v<N>``, then ``POST /update_weights_from_disk``.

vLLM (``rl_core.inference.vllm``) takes both through its own routes: the broadcast into
Steep's weight-transfer engine in its workers (``rl_core.inference.vllm_transfer``), the disk
path by its ``reload_weights``; a vLLM without that engine (``weight_broadcast`` false in its
server info) takes every version from disk, said once as an event.

Stalls. The torch engine receives or loads beside generation and swaps the new weights
in between two decode steps (``swap_seconds``); requests in flight continue and report
per-token versions, so the orchestration sends no pause. SGLang would otherwise take its
model-update write lock, which waits for every in-flight request to finish; so for SGLang
(and vLLM) servers the update is wrapped in ``pause_generation(mode="in_place")`` →
update → ``continue_generation`` (requests stay in the batch with their KV cache; the
update skips the lock while paused; ``flush_cache`` is false, since SGLang refuses to flush
with requests in the batch). There the stall is the transfer itself (the broadcast, or
the load from disk). ``pause_mode`` overrides the choice (``"retract"``, ``"abort"``).

Watchdog. Every group operation and HTTP call of an update is bounded by ``timeout_s``
(``STEEP_WEIGHT_SYNC_TIMEOUT_S``, default 120 s; HTTP calls get 15 s more so the
server's own group timeout answers first). A server whose distributed update fails or
times out is reported as a run event and moves to ``disk`` for the rest of the run; the
group is destroyed and recreated with the remaining servers at the next update. When the
disk path is impossible too (no ``weights_dir``, or the server is gone), ``push`` raises
``WeightSyncError`` with a message saying so. Nothing waits unbounded.

Metrics per update (``last_timing``): ``weight_sync/bytes`` (tensor bytes broadcast, or
the size of the saved weights), ``timing/weight_transfer`` (broadcast, or save + load),
``timing/inference_stall`` (the longest time a server stood still: paused, or swapping),
``timing/weight_sync`` (the whole push).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_core.inference.client import InferenceUnavailable
from rl_core.inference.vllm import client_for

logger = logging.getLogger(__name__)

STRATEGIES = ("distributed", "disk")
DEFAULT_TIMEOUT_S = float(os.environ.get("STEEP_WEIGHT_SYNC_TIMEOUT_S", "120"))
GROUP_NAME = "steep_weight_sync"
_HTTP_MARGIN_S = 15.0


class WeightSyncError(RuntimeError):
    """Weights could not reach a server by any strategy."""


def _weights_name(version: int) -> str:
    return f"v{version:06d}"


def dir_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


class _Server:
    def __init__(self, url: str, backend: str):
        self.url = url
        self.client = client_for(backend, url)
        self.kind: dict[str, Any] | None = None  # torch engine or not, device, tp size
        self.disk_only = False


class WeightSync:
    """Publish a trainer's weights to every server at ``urls`` (see the module docstring).

    ``trainer``: anything with ``version`` and ``save_weights``; for ``distributed`` also
    ``weight_metadata``, ``init_weight_group``, ``broadcast_weights`` and
    ``destroy_weight_group`` (``PPOTrainer``, ``TrainerGroup``), and optionally
    ``weight_group_address()`` (where the servers reach rank 0; default 127.0.0.1).
    ``reporter``: where events go (``TrainingLoop`` sets its own). Only the last ``keep``
    weight directories stay on disk; ``weights_dir`` must be readable by the servers.
    """

    def __init__(
        self,
        urls: Sequence[str],
        weights_dir: str | Path | None,
        *,
        strategy: str = "disk",
        keep: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pause_mode: str = "auto",
        reporter: Any = None,
        skip_unreachable: bool = False,
        backend: str = "torch",
    ):
        if keep < 1:
            raise ValueError("WeightSync keeps at least the newest weights (keep >= 1)")
        if strategy not in STRATEGIES:
            raise ValueError(f"weight_sync strategy {strategy!r}: use one of {STRATEGIES}")
        if strategy == "disk" and weights_dir is None:
            raise ValueError("the disk strategy needs a weights_dir")
        self.urls = list(urls)
        self.backend = backend  # whose protocol the servers speak (client_for)
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.strategy, self.keep, self.timeout_s = strategy, keep, timeout_s
        self.pause_mode = pause_mode
        self.reporter = reporter
        # A server that cannot be reached is left out of a push instead of failing it: someone
        # restarts it and calls resync (workers.ray_job.watch_servers). False: push raises.
        self.skip_unreachable = skip_unreachable
        self.last_timing: dict[str, float] = {}
        self._servers: list[_Server] | None = None
        self._group: list[_Server] = []  # the members of the live group, empty when none
        self._metadata: dict[str, list] | None = None
        self.updates = 0  # pushes done

    # ----- helpers

    def _get_servers(self) -> list[_Server]:
        if self._servers is None:
            self._servers = [_Server(url, self.backend) for url in self.urls]
        return self._servers

    async def _bounded(self, awaitable: Any, what: str, extra: float = _HTTP_MARGIN_S) -> Any:
        try:
            return await asyncio.wait_for(awaitable, self.timeout_s + extra)
        except TimeoutError:
            raise WeightSyncError(
                f"{what} did not finish within {self.timeout_s + extra:g} s"
            ) from None

    async def _event(self, kind: str, message: str) -> None:
        logger.warning("%s", message)
        if self.reporter is not None:
            try:
                await self.reporter.event(kind, message)
            except Exception:  # reporting must not break the sync
                logger.exception("could not report a weight sync event")

    async def _kind(self, server: _Server) -> dict[str, Any]:
        if server.kind is None:
            info = await self._bounded(
                server.client.get_server_info(), f"{server.url}: server_info"
            )
            version = str(info.get("version", ""))
            torch_engine = version.startswith("steep-torch-engine")
            device = str(info.get("device") or ("cpu" if torch_engine else "cuda"))
            server.kind = {
                "torch_engine": torch_engine,
                # Its group takes Steep's timeout_s (SGLang's own uses its default).
                "group_timeout": torch_engine or version.startswith("vllm"),
                "cpu": device.startswith("cpu"),
                "tp": int(info.get("tp_size") or 1),
                # False: the server takes no broadcast (a vLLM launched without Steep's
                # weight-transfer engine): disk for every version.
                "broadcast": bool(info.get("weight_broadcast", True)),
            }
        return server.kind

    def _pause_mode(self, kind: dict[str, Any]) -> str | None:
        if self.pause_mode != "auto":
            return None if self.pause_mode == "none" else self.pause_mode
        return None if kind["torch_engine"] else "in_place"

    # ----- push

    async def push(self, trainer: Any) -> int:
        """Publish ``trainer``'s current weights as version ``trainer.version``; return it."""
        version = int(trainer.version)
        started = time.perf_counter()
        stats = {"bytes": 0.0, "transfer": 0.0, "stall": 0.0, "save": 0.0}
        servers = self._get_servers()
        disk = list(servers)
        if self.strategy == "distributed":
            for server in servers:
                if not server.disk_only and not (await self._kind(server))["broadcast"]:
                    server.disk_only = True
                    await self._event(
                        "weight_sync",
                        f"{server.url} takes each version from disk: its engine joins no "
                        "weight broadcast.",
                    )
            candidates = [s for s in servers if not s.disk_only]
            disk = [s for s in servers if s.disk_only]
            if candidates:
                disk += await self._push_distributed(trainer, version, candidates, stats)
        if disk:
            await self._push_disk(trainer, version, disk, stats)
        self.updates += 1
        self.last_timing = {
            "weight_sync/bytes": stats["bytes"],
            "timing/weight_transfer": stats["transfer"],
            "timing/inference_stall": stats["stall"],
            "timing/weight_sync": time.perf_counter() - started,
        }
        if stats["save"]:
            self.last_timing["timing/save_weights"] = stats["save"]
        return version

    async def resync(self, trainer: Any, url: str) -> None:
        """The server at ``url`` was restarted (a fresh process with the base weights): it takes
        the trainer's current weights from disk now. Its old process was a member of the
        broadcast group, so the group is rebuilt, with the new one, at the next ``push``."""
        server = next((s for s in self._get_servers() if s.url == url), None)
        if server is None:
            raise ValueError(f"{url} is not one of this weight sync's servers")
        server.kind = None  # the new process may be another build
        server.disk_only = False  # a fresh process joins the rebuilt group at the next push
        if self._group:
            try:
                await asyncio.wait_for(
                    self._destroy_group(trainer), self.timeout_s + _HTTP_MARGIN_S
                )
            except Exception:
                logger.exception("could not destroy the weight group")
            self._group = []
        stats = {"bytes": 0.0, "transfer": 0.0, "stall": 0.0, "save": 0.0}
        await self._push_disk(trainer, int(trainer.version), [server], stats)

    async def _paused(self, server: _Server, update: Any, mode: str | None) -> tuple[Any, float]:
        """Run ``update`` on ``server`` (inside a pause when ``mode``); its answer and the stall."""
        if mode is None:
            answer = await self._bounded(update, f"{server.url}: weight update")
            return answer, float((answer or {}).get("swap_seconds") or 0.0)
        await self._bounded(server.client.pause_generation(mode), f"{server.url}: pause")
        paused = time.perf_counter()
        try:
            answer = await self._bounded(update, f"{server.url}: weight update")
        finally:  # a server left paused would hang every rollout
            await self._bounded(server.client.continue_generation(), f"{server.url}: continue")
        return answer, time.perf_counter() - paused

    # ----- disk

    async def _push_disk(
        self, trainer: Any, version: int, servers: list[_Server], stats: dict[str, float]
    ) -> None:
        if self.weights_dir is None:
            raise WeightSyncError(
                "weights could not reach "
                + ", ".join(s.url for s in servers)
                + " by broadcast, and the disk fallback has no weights directory"
            )
        started = time.perf_counter()
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        target = self.weights_dir / _weights_name(version)
        path = await asyncio.to_thread(trainer.save_weights, str(target))
        saved = time.perf_counter()
        stats["save"] = saved - started
        stats["bytes"] += await asyncio.to_thread(dir_bytes, path)

        async def one(server: _Server) -> float:
            kind = await self._kind(server)
            mode = self._pause_mode(kind)
            update = server.client.update_weights_from_disk(
                path, weight_version=version, flush_cache=False if mode == "in_place" else None
            )
            _, stall = await self._paused(server, update, mode)
            return stall

        results = await asyncio.gather(*(one(s) for s in servers), return_exceptions=True)
        failures = [
            (s, r) for s, r in zip(servers, results, strict=True) if isinstance(r, BaseException)
        ]
        gone = [s for s, r in failures if isinstance(r, InferenceUnavailable)]
        if self.skip_unreachable and gone:
            failures = [(s, r) for s, r in failures if s not in gone]
            await self._event(
                "weight_sync",
                f"{', '.join(s.url for s in gone)} unreachable: left out of version {version}; "
                "it takes the current weights when it is back.",
            )
        if failures:
            detail = "; ".join(f"{s.url}: {r}" for s, r in failures)
            raise WeightSyncError(f"update_weights_from_disk of version {version} failed: {detail}")
        stalls = [float(r) for r in results if not isinstance(r, BaseException)]
        stats["stall"] = max([stats["stall"], *stalls])
        stats["transfer"] += time.perf_counter() - started
        self._prune()

    def _prune(self) -> None:
        assert self.weights_dir is not None
        dirs = sorted(
            (p for p in self.weights_dir.glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit()),
            key=lambda p: int(p.name[1:]),
        )
        for old in dirs[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ----- distributed

    async def _push_distributed(
        self, trainer: Any, version: int, servers: list[_Server], stats: dict[str, float]
    ) -> list[_Server]:
        """Broadcast to ``servers``; the servers it failed for (now disk only)."""
        try:
            kinds = [await self._kind(s) for s in servers]
            if self._group != servers:
                await self._destroy_group(trainer)
                await self._init_group(trainer, servers, kinds)
            if self._metadata is None:
                self._metadata = await asyncio.to_thread(trainer.weight_metadata)
        except Exception as exc:
            await self._fail(trainer, servers, f"could not set up the weight group: {exc}")
            return servers
        meta = self._metadata
        assert meta is not None
        started = time.perf_counter()

        async def one(server: _Server, kind: dict[str, Any]) -> float:
            mode = self._pause_mode(kind)
            update = server.client.update_weights_from_distributed(
                meta["names"],
                meta["dtypes"],
                meta["shapes"],
                group_name=GROUP_NAME,
                weight_version=version,
                flush_cache=mode != "in_place",
            )
            answer, stall = await self._paused(server, update, mode)
            return stall

        send = asyncio.ensure_future(
            self._bounded(
                asyncio.to_thread(trainer.broadcast_weights, GROUP_NAME),
                "the trainer's broadcast",
                5.0,
            )
        )
        updates = [asyncio.ensure_future(one(s, k)) for s, k in zip(servers, kinds, strict=True)]
        await asyncio.wait([send])
        crash = send.exception()
        if crash is not None and not isinstance(crash, WeightSyncError):
            # The trainer itself failed (its process died mid-update, say), not the transfer:
            # no server can finish this update and there are no weights to fall back to.
            for update in updates:
                update.cancel()
            await asyncio.gather(*updates, return_exceptions=True)
            raise crash
        answers = await asyncio.gather(*updates, return_exceptions=True)
        sent = crash if crash is not None else send.result()
        failed = [s for s, r in zip(servers, answers, strict=True) if isinstance(r, BaseException)]
        trainer_error = (
            sent
            if isinstance(sent, BaseException)
            else None
            if sent.get("ok")
            else sent.get("error")
        )
        if failed or trainer_error:
            why = "; ".join(
                [f"trainer: {trainer_error}"] * bool(trainer_error)
                + [
                    f"{s.url}: {r}"
                    for s, r in zip(servers, answers, strict=True)
                    if isinstance(r, BaseException)
                ]
            )
            # The group is broken for everyone; servers that did not take the update go to disk.
            await self._fail(
                trainer, failed or servers, f"broadcast of version {version} failed ({why})"
            )
            return failed or servers
        assert not isinstance(sent, BaseException)
        stats["bytes"] += float(sent.get("bytes", 0))
        stats["transfer"] += time.perf_counter() - started
        stats["stall"] = max([stats["stall"], *(float(a) for a in answers)])  # type: ignore[arg-type]
        return []

    async def _init_group(self, trainer: Any, servers: list[_Server], kinds: list[dict]) -> None:
        if all(k["cpu"] for k in kinds):
            backend = "gloo"
        elif not any(k["cpu"] for k in kinds):
            backend = "nccl"
        else:
            raise WeightSyncError("servers on CPUs and on GPUs cannot share one weight group")
        address = getattr(trainer, "weight_group_address", None)
        if address is not None:
            host, port = await asyncio.to_thread(address)
        else:
            from rl_core.inference.process import free_port

            host, port = "127.0.0.1", free_port("127.0.0.1")
        world_size = 1 + sum(k["tp"] for k in kinds)
        # A group left over from an earlier sync (this job's previous WeightSync) goes first.
        await asyncio.gather(
            *(
                asyncio.wait_for(s.client.destroy_weights_update_group(GROUP_NAME), 10.0)
                for s in servers
            ),
            return_exceptions=True,
        )
        join = asyncio.to_thread(
            trainer.init_weight_group,
            master_address=host,
            master_port=port,
            world_size=world_size,
            group_name=GROUP_NAME,
            backend=backend,
            timeout_s=self.timeout_s,
        )
        posts, offset = [], 1
        for server, kind in zip(servers, kinds, strict=True):
            extra = {"timeout_s": self.timeout_s} if kind["group_timeout"] else {}
            posts.append(
                server.client.init_weights_update_group(
                    host, port, offset, world_size, group_name=GROUP_NAME, backend=backend, **extra
                )
            )
            offset += kind["tp"]
        results = await asyncio.gather(
            self._bounded(join, "the trainer's group join", 5.0),
            *(self._bounded(p, "init_weights_update_group") for p in posts),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise WeightSyncError("; ".join(str(e) for e in errors))
        self._group = list(servers)

    async def _destroy_group(self, trainer: Any) -> None:
        members, self._group = self._group, []
        await asyncio.to_thread(trainer.destroy_weight_group, GROUP_NAME)
        if members:
            await asyncio.gather(
                *(
                    asyncio.wait_for(s.client.destroy_weights_update_group(GROUP_NAME), 10.0)
                    for s in members
                ),
                return_exceptions=True,
            )

    async def _fail(self, trainer: Any, servers: list[_Server], message: str) -> None:
        for server in servers:
            server.disk_only = True
        self._group = self._group or list(servers)  # destroy what may exist on any of them
        try:
            await asyncio.wait_for(self._destroy_group(trainer), self.timeout_s + _HTTP_MARGIN_S)
        except Exception:
            logger.exception("could not destroy the weight group")
            self._group = []
        await self._event(
            "weight_sync",
            f"Distributed weight sync failed, {message}; "
            + ", ".join(s.url for s in servers)
            + " now take(s) weights from disk.",
        )

    async def aclose(self, trainer: Any = None) -> None:
        """Close the clients; with ``trainer``, leave the weight group on both sides first."""
        if trainer is not None and self._group:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._destroy_group(trainer), self.timeout_s)
        if self._servers is not None:
            await asyncio.gather(*(s.client.aclose() for s in self._servers))
            self._servers = None
