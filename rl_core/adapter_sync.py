"""Publish a LoRA run's policy to its inference servers as a new adapter, with no pause.

``WeightSync`` (full weights) saves the merged model and has every server reload it,
pausing inference. A LoRA run changes only its adapter, and both backends serve adapters
natively (SGLang's ``/load_lora_adapter``; the torch engine's ``lora.py``), so
``AdapterSync.push`` instead:

1. saves the adapter alone (``trainer.save_adapter``; a few MB) to ``adapters_dir/v<N>``;
2. loads it on every server under a new name ``<prefix>-v<N>``
   (``rl_core.inference.adapters``) while they keep serving: nothing is paused or aborted;
3. from then on new requests name it (``lora_path``): the gateway and the rollout driver
   derive the name from the run's current version, and the client tags their tokens
   with ``N``; with an ``AdapterSwitch`` (the rollout driver's), the generations still
   running under older versions are moved onto it (aborted by rid and resumed under the new
   name), so a long answer's later tokens are the new version's rather than all of it
   aging with the version it started at;
4. retires old names: the adapter ``keep`` versions back is unloaded in the background.
   An unload refuses new requests under the name at once and completes when the
   requests still running under it have finished (SGLang's registry semantics; the
   torch engine does the same). ``keep = 2`` leaves the previous version loaded for one
   more step, so a request that read the version just before the switch still finds
   its adapter.

Requests under other adapters, or under the base model, are never touched. Same
interface as ``WeightSync`` (``push``, ``last_timing``, ``aclose``): ``TrainingLoop``
takes either. ``adapters_dir`` must be readable by the servers at the same path.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from rl_core.inference.adapters import AdapterSwitch, adapter_name, role_prefix
from rl_core.inference.client import InferenceClient, InferenceUnavailable
from rl_core.inference.vllm import client_for
from rl_core.weight_sync import dir_bytes

logger = logging.getLogger(__name__)


class AdapterSync:
    """Load each new policy version on every server as adapter ``<prefix>-v<N>``; retire old ones."""

    def __init__(
        self,
        urls: Sequence[str],
        adapters_dir: str | Path,
        prefix: str,
        *,
        keep: int = 2,
        refresh: Callable[[], Awaitable[list[str]]] | None = None,
        on_change: Callable[[list[str], list[str]], Awaitable[None]] | None = None,
        skip_unreachable: bool = False,
        switch: AdapterSwitch | None = None,
        backend: str = "torch",
    ):
        if keep < 1:
            raise ValueError("AdapterSync keeps at least the newest adapter loaded (keep >= 1)")
        # A shared pool's servers change while the run trains: ``refresh`` reads them before
        # each push; ``on_change(added, removed)`` is told once the new version is on the added.
        self.refresh, self.on_change = refresh, on_change
        self.urls = list(urls)
        self.adapters_dir = Path(adapters_dir)
        self.prefix = prefix
        self.keep = keep
        self.skip_unreachable = skip_unreachable  # as WeightSync's: restarted and resynced later
        self.switch = switch  # moves the requests in flight onto each new version
        self.backend = backend  # whose protocol the servers speak (client_for)
        self.current: str | None = None  # the newest adapter's name
        self.loaded: list[tuple[int, str]] = []  # (version, name), oldest first, not yet retired
        self.last_timing: dict[str, float] = {}
        self.reporter: Any = None  # as WeightSync's; an adapter load has no fallback to report
        self._clients: list[InferenceClient] | None = None
        self._retiring: set[asyncio.Task[None]] = set()

    def _get_clients(self) -> list[InferenceClient]:
        if self._clients is None:
            self._clients = [client_for(self.backend, url) for url in self.urls]
        return self._clients

    async def push(self, trainer: Any) -> int:
        """Publish ``trainer``'s adapter as version ``trainer.version``; return the version."""
        version = int(trainer.version)
        name = adapter_name(self.prefix, version)
        started = time.perf_counter()
        added, removed = await self._refresh_servers()
        self.adapters_dir.mkdir(parents=True, exist_ok=True)
        path = await asyncio.to_thread(trainer.save_adapter, str(self.adapters_dir / f"v{version}"))
        saved = time.perf_counter()
        clients = self._get_clients()
        if any(n == name for _, n in self.loaded):  # pushed again (a resume): replace it
            await self._unload(name, clients)
            self.loaded = [(v, n) for v, n in self.loaded if n != name]
        results = await asyncio.gather(
            *(c.load_lora_adapter(name, path) for c in clients), return_exceptions=True
        )
        failed = [
            (url, r)
            for url, r in zip(self.urls, results, strict=True)
            if isinstance(r, BaseException)
            and not (self.skip_unreachable and isinstance(r, InferenceUnavailable))
        ]
        if failed:
            # Leave no server with a name the others lack.
            await asyncio.gather(
                *(
                    c.unload_lora_adapter(name)
                    for c, r in zip(clients, results, strict=True)
                    if not isinstance(r, BaseException)
                ),
                return_exceptions=True,
            )
            url, error = failed[0]
            raise RuntimeError(f"load_lora_adapter {name} failed on {url}: {error!r}") from error
        loaded = time.perf_counter()
        if self.on_change is not None and (added or removed):
            await self.on_change(added, removed)
        self.current = name
        self.loaded.append((version, name))
        moved = await self.switch.switch(name) if self.switch is not None else 0
        while len(self.loaded) > self.keep:
            _, old = self.loaded.pop(0)
            task = asyncio.create_task(self._unload(old, clients))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        # WeightSync's metrics: an adapter load stalls no generation (nothing pauses).
        self.last_timing = {
            "weight_sync/bytes": float(dir_bytes(path)),
            "timing/weight_transfer": loaded - started,
            "timing/inference_stall": 0.0,
            "timing/save_weights": saved - started,
            "timing/update_weights": loaded - saved,
            "timing/weight_sync": loaded - started,
        }
        if self.switch is not None:
            self.last_timing["weight_sync/requests_moved"] = float(moved)
        self._prune()
        return version

    async def _refresh_servers(self) -> tuple[list[str], list[str]]:
        """Take the servers ``refresh`` lists now; the added and removed URLs."""
        if self.refresh is None:
            return [], []
        urls = list(await self.refresh())
        added = [url for url in urls if url not in self.urls]
        removed = [url for url in self.urls if url not in urls]
        if added or removed:
            old = dict(zip(self.urls, self._get_clients(), strict=True))
            for url in removed:
                await old.pop(url).aclose()
            self._clients = [old.get(url) or client_for(self.backend, url) for url in urls]
            self.urls = urls
        return added, removed

    async def resync(self, trainer: Any, url: str) -> None:
        """The server at ``url`` was restarted (the base model only): it loads the adapters
        still in use again, from the directories kept for them."""
        client = self._get_clients()[self.urls.index(url)]
        for version, name in self.loaded:
            await client.load_lora_adapter(name, str(self.adapters_dir / f"v{version}"))

    async def _unload(self, name: str, clients: list[InferenceClient]) -> None:
        results = await asyncio.gather(
            *(c.unload_lora_adapter(name) for c in clients), return_exceptions=True
        )
        for url, result in zip(self.urls, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("unload_lora_adapter %s on %s failed: %r", name, url, result)

    async def drain(self) -> None:
        """Wait until every retired adapter is unloaded (its requests finished)."""
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    async def unload_all(self) -> None:
        """Unload every adapter this sync loaded (a shared pool outlives the run)."""
        await self.drain()
        clients = self._get_clients()
        for _, name in self.loaded:
            await self._unload(name, clients)
        self.loaded, self.current = [], None

    def _prune(self) -> None:
        # Keep the directories of the adapters still loaded (a server may reload from them).
        live = {f"v{v}" for v, _ in self.loaded}
        for old in self.adapters_dir.glob("v[0-9]*"):
            if old.is_dir() and old.name[1:].isdigit() and old.name not in live:
                shutil.rmtree(old, ignore_errors=True)

    async def aclose(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*list(self._retiring), return_exceptions=True)
        if self._clients is not None:
            await asyncio.gather(*(c.aclose() for c in self._clients))
            self._clients = None


class RoleAdapterSync:
    """``AdapterSync`` for a multi-agent run (``RunConfig.roles``): each role's adapter is
    published as ``<prefix>-<role>-v<N>`` (``rl_core.inference.adapters.role_prefix``), from
    ``adapters_dir/<role>/v<N>``, by an ``AdapterSync`` of its own.

    ``push`` publishes every role at ``trainer.version`` (the roles share the run's versions,
    so staleness is counted in them): the adapters are saved one at a time (a distributed
    trainer's save is a collective) and loaded on the servers concurrently. A shared pool's
    servers are read once per push and ``on_change`` told once, when every role is on them.
    Same interface as ``AdapterSync``.
    """

    def __init__(
        self,
        urls: Sequence[str],
        adapters_dir: str | Path,
        prefix: str,
        roles: Sequence[str],
        *,
        keep: int = 2,
        refresh: Callable[[], Awaitable[list[str]]] | None = None,
        on_change: Callable[[list[str], list[str]], Awaitable[None]] | None = None,
        skip_unreachable: bool = False,
        backend: str = "torch",
    ):
        if not roles:
            raise ValueError(
                "RoleAdapterSync publishes a multi-agent run's roles: give at least one"
            )
        self.refresh, self.on_change = refresh, on_change
        self._servers: list[str] | None = None  # what refresh said for the push under way
        self.syncs = {
            role: AdapterSync(
                urls,
                Path(adapters_dir) / role,
                role_prefix(prefix, role),
                keep=keep,
                refresh=self._pool_servers if refresh is not None else None,
                skip_unreachable=skip_unreachable,
                backend=backend,
            )
            for role in roles
        }
        self.last_timing: dict[str, float] = {}
        self.reporter: Any = None
        self._saving = threading.Lock()  # one adapter save at a time, whole

    @property
    def urls(self) -> list[str]:
        return next(iter(self.syncs.values())).urls

    @property
    def current(self) -> dict[str, str | None]:
        """The newest adapter name of each role."""
        return {role: sync.current for role, sync in self.syncs.items()}

    async def _pool_servers(self) -> list[str]:
        if self._servers is None:
            assert self.refresh is not None
            self._servers = list(await self.refresh())
        return self._servers

    async def push(self, trainer: Any) -> int:
        """Publish every role's adapter as version ``trainer.version``; return the version."""
        started = time.perf_counter()
        before = list(self.urls)
        self._servers = None
        try:
            versions = await asyncio.gather(
                *(sync.push(_RoleTrainer(trainer, role, self._saving))
                  for role, sync in self.syncs.items())
            )  # fmt: skip
        finally:
            self._servers = None
        after = list(self.urls)
        added = [url for url in after if url not in before]
        removed = [url for url in before if url not in after]
        if self.on_change is not None and (added or removed):
            await self.on_change(added, removed)
        self.last_timing = _combined([sync.last_timing for sync in self.syncs.values()])
        self.last_timing["timing/weight_sync"] = time.perf_counter() - started
        self.last_timing["timing/weight_transfer"] = self.last_timing["timing/weight_sync"]
        return versions[0]

    async def resync(self, trainer: Any, url: str) -> None:
        """The server at ``url`` was restarted: every role's adapters in use are loaded again."""
        for sync in self.syncs.values():
            await sync.resync(trainer, url)

    async def drain(self) -> None:
        await asyncio.gather(*(sync.drain() for sync in self.syncs.values()))

    async def unload_all(self) -> None:
        for sync in self.syncs.values():
            await sync.unload_all()

    async def aclose(self) -> None:
        for sync in self.syncs.values():
            await sync.aclose()


class _RoleTrainer:
    """What one role's ``AdapterSync`` sees of the trainer: its version, and its role's save."""

    def __init__(self, trainer: Any, role: str, lock: threading.Lock):
        self.trainer, self.role, self.lock = trainer, role, lock
        self.version = trainer.version

    def save_adapter(self, path: str) -> str:
        with self.lock:
            return self.trainer.save_adapter(path, role=self.role)


def _combined(timings: list[dict[str, float]]) -> dict[str, float]:
    """The roles' push timings as one push's: bytes, requests moved and save times (one at a
    time) summed; the rest, which ran concurrently, the longest."""
    summed = ("weight_sync/bytes", "weight_sync/requests_moved", "timing/save_weights")
    out: dict[str, float] = {}
    for timing in timings:
        for key, value in timing.items():
            if key in summed:
                out[key] = out.get(key, 0.0) + value
            else:
                out[key] = max(out.get(key, value), value)
    return out
