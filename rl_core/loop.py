"""The training loop: batches of trajectories in, policy versions out, as named, timed phases.

One step of ``TrainingLoop.run`` (each phase timed as ``timing/<phase>``)::

    wait_batch   → source.next_batch(batch_size)        (rollouts keep running meanwhile)
    filter_stale → mask tokens older than max_staleness out of the loss; drop the
                   trajectories left with none to train; controller.on_dropped
    train_step   → trainer.train_step(batch) in a thread, so the event loop (and
                   with it generation) keeps going
    weight_sync  → publish the weights to the servers (``rl_core.weight_sync``: a
                   broadcast or a load from disk, swapped in between decode steps)
    report       → controller.on_version, reporter.version / .metrics, source.finished
    checkpoint   → every ``save_every`` steps and at the end (``rl_core.checkpoints``)

With traces on (``rl_core.tracing``) a step is a trace, ``steep.step``, a span per phase run.

The ``filter_stale`` phase is the one place staleness is enforced (the trainer trains what
it is given): a long episode keeps its stale early turns as context and trains its fresh
ones (``rl_core.staleness.mask_stale``); a trajectory with nothing fresh is dropped. The loop
refills the batch, gives the dropped slots back to the controller and reports
``staleness/dropped`` (trajectories) and ``staleness/masked_tokens`` per step. A partly
masked trajectory counts as trained.

The loop knows nothing about where trajectories come from: a ``TrajectorySource``
is an in-process queue fed by the rollout driver (``QueueSource``, see
``rl_core.rollout.LocalRun``) or, in a Ray job, the web app's internal API
(claimed sessions). Likewise a ``Reporter`` is a list (tests) or the internal API.

This module imports neither torch nor Django: the trainer is anything with
``train_step``/``save_weights``/``save_checkpoint``/``load_checkpoint``/``version``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rl_core import tracing
from rl_core.adapter_sync import AdapterSync
from rl_core.checkpoints import CheckpointInfo, latest_checkpoint, write_checkpoint
from rl_core.config import RunConfig
from rl_core.distill import TeacherScorer
from rl_core.staleness import StalenessController, mask_stale
from rl_core.types import Trajectory
from rl_core.weight_sync import WeightSync  # re-exported: it lived here

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- protocols


@runtime_checkable
class TrajectorySource(Protocol):
    """Where trained trajectories come from; keys identify episodes (or sessions)."""

    async def next_batch(self, n: int) -> list[tuple[str, Trajectory]]:
        """Wait until ``n`` trajectories are ready and hand them over (fewer only when the source closed).

        The loop cancels this call when it is stopped; trajectories a source handed to a
        cancelled call are lost to this run (the web app releases unfinished claims).
        """
        ...

    async def finished(self, trained: list[str], dropped: list[str], version: int) -> None:
        """``trained`` keys went into the step that produced policy ``version``; ``dropped`` were too stale."""
        ...


@runtime_checkable
class Reporter(Protocol):
    """Where a run's progress goes: the dashboard (through the internal API) or a test's lists."""

    async def metrics(self, step: int, version: int, values: dict[str, float]) -> None: ...

    async def version(self, v: int) -> None: ...

    async def checkpoint(self, version: int, step: int, path: str, size_bytes: int) -> None: ...

    async def event(self, kind: str, message: str) -> None: ...


class Trainer(Protocol):
    """What the loop needs of ``rl_core.trainer.PPOTrainer``."""

    version: int

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]: ...

    def save_weights(self, path: str) -> str: ...

    def save_checkpoint(self, path: str) -> str: ...

    def load_checkpoint(self, path: str) -> None: ...


class NullReporter:
    """Reports nothing."""

    async def metrics(self, step: int, version: int, values: dict[str, float]) -> None:
        pass

    async def version(self, v: int) -> None:
        pass

    async def checkpoint(self, version: int, step: int, path: str, size_bytes: int) -> None:
        pass

    async def event(self, kind: str, message: str) -> None:
        pass


@dataclass
class ListReporter:
    """Keeps every report in lists (tests, benchmarks, scripts)."""

    metrics_log: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)

    async def metrics(self, step: int, version: int, values: dict[str, float]) -> None:
        self.metrics_log.append((step, version, dict(values)))

    async def version(self, v: int) -> None:
        self.versions.append(v)

    async def checkpoint(self, version: int, step: int, path: str, size_bytes: int) -> None:
        self.checkpoints.append(
            {"version": version, "step": step, "path": path, "size_bytes": size_bytes}
        )

    async def event(self, kind: str, message: str) -> None:
        self.events.append((kind, message))

    def series(self, name: str) -> list[float]:
        """One metric over the steps that reported it, in step order."""
        return [values[name] for _, _, values in self.metrics_log if name in values]


# --------------------------------------------------------------------------- sources


class QueueSource:
    """An in-process ``TrajectorySource``: a queue the rollout driver puts into.

    Trajectories are handed out in arrival order; a driver that puts whole groups
    keeps groups whole in every batch when ``batch_size`` is a multiple of
    ``group_size``. ``next_batch`` takes nothing until it can take all ``n``, so a
    cancelled call loses nothing. One event loop only (not thread-safe).
    """

    def __init__(self) -> None:
        self._items: collections.deque[tuple[str, Trajectory]] = collections.deque()
        self._changed = asyncio.Event()
        self._closed = False
        self.trained = 0
        self.dropped = 0

    async def put(self, key: str, trajectory: Trajectory) -> None:
        if self._closed:
            raise RuntimeError("QueueSource is closed")
        self._items.append((key, trajectory))
        self._changed.set()

    def qsize(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """No more trajectories: a waiting ``next_batch`` returns what there is."""
        self._closed = True
        self._changed.set()

    async def next_batch(self, n: int) -> list[tuple[str, Trajectory]]:
        while len(self._items) < n and not self._closed:
            self._changed.clear()
            await self._changed.wait()
        return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    async def finished(self, trained: list[str], dropped: list[str], version: int) -> None:
        self.trained += len(trained)
        self.dropped += len(dropped)


# --------------------------------------------------------------------------- the loop


@dataclass
class LoopSummary:
    """How ``TrainingLoop.run`` ended."""

    step: int
    version: int
    stopped: bool  # stop() was called (or the source ran dry) before max_steps
    checkpoint: str | None  # the last checkpoint written or resumed from
    dropped: int = 0  # trajectories dropped as stale over this run() call


class _Phases:
    """Wall time of the loop's named phases for one step, as ``timing/<phase>``; with traces on,
    the step's trace (``steep.step``) with a span per phase."""

    def __init__(self, step: int) -> None:
        self.times: dict[str, float] = {}
        self.trace = tracing.start("steep.step", {"steep.step": step}) if tracing.ON else None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        if self.trace is not None:
            self.trace.begin(f"steep.step.{name}")
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.times[f"timing/{name}"] = (
                self.times.get(f"timing/{name}", 0.0) + time.perf_counter() - start
            )
            if self.trace is not None:
                self.trace.end(error=error)


class TrainingLoop:
    """Asynchronous, staleness-bounded PPO training from a ``TrajectorySource``.

    ``step`` counts trained batches; ``trainer.version`` is the policy version
    (one per step). With a ``checkpoint_dir`` that already holds a checkpoint,
    ``run`` first restores it and continues from its step and version (and
    pushes the restored weights to the servers). ``stop()`` ends the loop after
    the current step, with a final checkpoint.
    """

    def __init__(
        self,
        cfg: RunConfig,
        trainer: Trainer,
        source: TrajectorySource,
        weight_sync: WeightSync | AdapterSync | None,
        reporter: Reporter | None = None,
        controller: StalenessController | None = None,
        checkpoint_dir: str | Path | None = None,
        *,
        keep_checkpoints: int | None = None,
        teacher: TeacherScorer | None = None,
    ):
        self.cfg = cfg
        self.trainer = trainer
        self.source = source
        self.weight_sync = weight_sync
        self.reporter: Reporter = reporter or NullReporter()
        if weight_sync is not None and weight_sync.reporter is None:
            weight_sync.reporter = self.reporter  # its fallbacks are run events
        self.controller = controller
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_checkpoints = keep_checkpoints
        self.teacher = teacher  # on-policy distillation: scores each batch before its step
        self.step = 0
        self.last_checkpoint: str | None = None
        self._checkpoint_step: int | None = None
        # An asynchronous checkpoint being written while training goes on (one at a time).
        self._writing: asyncio.Task[None] | None = None
        self._prepared = False
        self._resumed: CheckpointInfo | None = None  # restored, not yet pushed to the servers
        self._stop_requested = threading.Event()
        self._stop_event: asyncio.Event | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._last_step_end: float | None = None
        # Held from a step's update to its weights reaching the servers: the weights and
        # trainer.version agree outside it (``resync_server``).
        self.weights_lock = asyncio.Lock()

    @property
    def version(self) -> int:
        return int(self.trainer.version)

    # ----- control

    def stop(self) -> None:
        """End after the current step (a wait for a batch is cancelled); thread-safe."""
        self._stop_requested.set()
        if self._aloop is not None and self._stop_event is not None:
            with contextlib.suppress(RuntimeError):  # the event loop already closed
                self._aloop.call_soon_threadsafe(self._stop_event.set)

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    def restore(self) -> CheckpointInfo | None:
        """Load the latest checkpoint in ``checkpoint_dir``, if any (idempotent; ``run`` calls it).

        Call it (or ``prepare``) before starting rollouts so that admission starts from
        the restored version; ``prepare`` also pushes the restored weights to the servers.
        """
        if self._prepared:
            return None
        self._prepared = True
        info = latest_checkpoint(self.checkpoint_dir)
        if info is None:
            return None
        self.trainer.load_checkpoint(str(info.path))
        if self.version != info.version:
            raise RuntimeError(
                f"checkpoint {info.path} holds version {self.version} but its loop state says {info.version}"
            )
        self.step = info.step
        self.last_checkpoint = str(info.path)
        self._checkpoint_step = info.step
        if self.controller is not None:
            self.controller.on_resume(info.version)
            self.controller.restore_counters(info.counters)
        self._resumed = info
        logger.info("resumed from %s at step %d, version %d", info.path, info.step, info.version)
        return info

    async def prepare(self) -> None:
        """``restore`` and, after a restore, push the restored weights to the servers (idempotent)."""
        self.restore()
        if self._resumed is None:
            return
        info, self._resumed = self._resumed, None
        if self.weight_sync is not None:
            await self.weight_sync.push(self.trainer)
        await self.reporter.version(self.version)
        await self.reporter.event(
            "resumed", f"Resumed from step {info.step} (version {info.version})."
        )

    # ----- the loop

    async def resync_server(self, url: str) -> int:
        """A server at ``url`` was started again (a fresh process, base weights): give it the
        current policy now, between two steps. Returns the version it serves."""
        if self.weight_sync is None:
            return self.version
        async with self.weights_lock:
            await self.weight_sync.resync(self.trainer, url)
            return self.version

    async def run(self, max_steps: int | None = None) -> LoopSummary:
        """Train until ``step == max_steps`` (default ``cfg.max_steps``; counted across resumes) or ``stop()``."""
        max_steps = self.cfg.max_steps if max_steps is None else max_steps
        self._aloop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if self._stop_requested.is_set():
            self._stop_event.set()
        await self.prepare()
        dropped_total = 0
        self._last_step_end = time.perf_counter()
        try:
            while self.step < max_steps and not self.stopping:
                dropped = await self._one_step()
                if dropped is None:  # stopped while waiting, or the source ran dry
                    break
                dropped_total += dropped
            await self._checkpoint_written()
        except Exception as exc:
            await self.reporter.event(
                "error", f"Training failed at step {self.step + 1}: {type(exc).__name__}: {exc}"
            )
            with contextlib.suppress(Exception):  # what was saved before the failure still lands
                await self._checkpoint_written()
            raise
        if self.step > 0 and self._checkpoint_step != self.step:
            await self._checkpoint()
            await self._checkpoint_written()
        stopped = self.step < max_steps
        await self.reporter.event(
            "stopped" if stopped else "completed",
            f"Training {'stopped' if stopped else 'completed'} at step {self.step} (version {self.version}).",
        )
        return LoopSummary(
            step=self.step,
            version=self.version,
            stopped=stopped,
            checkpoint=self.last_checkpoint,
            dropped=dropped_total,
        )

    async def _wait_batch(self, n: int) -> list[tuple[str, Trajectory]] | None:
        """``n`` trajectories from the source, or ``None`` once ``stop()`` was called."""
        assert self._stop_event is not None
        if self.stopping:
            return None
        batch = asyncio.ensure_future(self.source.next_batch(n))
        stop = asyncio.ensure_future(self._stop_event.wait())
        try:
            await asyncio.wait({batch, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if self.stopping or not batch.done():
            batch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await batch
            return None
        return batch.result()

    async def _one_step(self) -> int | None:
        """Collect a batch and train on it; ``None`` when the loop should end, else the drop count."""
        phases = _Phases(self.step + 1)
        try:
            dropped = await self._step(phases)
        except BaseException as exc:
            if phases.trace is not None:
                phases.trace.finish(error=exc)
            raise
        if phases.trace is not None:
            phases.trace.finish({"steep.trained": dropped is not None})
        return dropped

    async def _step(self, phases: _Phases) -> int | None:
        cfg = self.cfg
        if self._writing is not None and self._writing.done():
            await self._checkpoint_written()  # a failed write fails the run here, not later
        kept: list[tuple[str, Trajectory]] = []
        dropped_keys: list[str] = []
        masked_tokens = 0
        train_version = self.version
        # Refill until batch_size fresh trajectories: the admission rule assumes every
        # version consumes a full batch; training short batches would let the surplus
        # pile up in the queue, grow stale and be dropped, freeing yet more admissions.
        while len(kept) < cfg.batch_size:
            wanted = cfg.batch_size - len(kept)
            with phases.phase("wait_batch"):
                items = await self._wait_batch(wanted)
            if items is None:  # stop() while waiting: a partial batch is not trained
                if dropped_keys:
                    await self.source.finished([], dropped_keys, self.version)
                return None
            with phases.phase("filter_stale"):
                stale = 0
                for key, traj in items:
                    fresh, masked = mask_stale(traj, train_version, cfg.max_staleness)
                    masked_tokens += masked
                    if fresh is not None:
                        kept.append((key, fresh))
                    else:
                        dropped_keys.append(key)
                        stale += 1
                if stale and self.controller is not None:
                    # Now, not after the step: their slots admit the replacements waited for here.
                    self.controller.on_dropped(stale)
            if len(items) < wanted:  # the source ran dry: train what there is
                break
        if dropped_keys:
            logger.info(
                "dropped %d trajectories more than %d versions old",
                len(dropped_keys),
                cfg.max_staleness,
            )
        if not kept:  # the source ran dry
            if dropped_keys:
                await self.source.finished([], dropped_keys, self.version)
            return None

        trajectories = [t for _, t in kept]
        distill: dict[str, float] = {}
        if self.teacher is not None:
            with phases.phase("teacher"):
                distill = await self.teacher.score(trajectories)
        sync_timing: dict[str, float] = {}
        async with self.weights_lock:  # a restarted server's catch-up waits for this version
            with phases.phase("train_step"):
                stats = await asyncio.to_thread(self.trainer.train_step, trajectories)
            self.step += 1
            with phases.phase("weight_sync"):
                if self.weight_sync is not None:
                    await self.weight_sync.push(self.trainer)
                    sync_timing = self.weight_sync.last_timing
        version = self.version
        if self.controller is not None:
            self.controller.on_version(version)

        with phases.phase("report"):
            await self.reporter.version(version)
            await self.source.finished([k for k, _ in kept], dropped_keys, version)
        now = time.perf_counter()
        assert self._last_step_end is not None
        step_time, self._last_step_end = now - self._last_step_end, now
        values = {
            **{k: float(v) for k, v in stats.items()},
            **rollout_stats(trajectories),
            **sync_timing,
            **distill,
            **phases.times,
            "staleness/dropped": float(len(dropped_keys)),
            "staleness/masked_tokens": float(masked_tokens),
            "timing/step": step_time,
            "perf/trajectories_per_s": len(trajectories) / step_time if step_time > 0 else 0.0,
            "step": float(self.step),
        }
        if self.controller is not None:
            values.update({k: float(v) for k, v in self.controller.stats().items()})
        if phases.trace is not None:
            phases.trace.note(
                {
                    "steep.version": version,
                    "steep.trajectories": len(trajectories),
                    "steep.staleness.dropped": len(dropped_keys),
                }
            )
        await self.reporter.metrics(self.step, version, values)
        logger.info(
            "step %d → version %d: reward %.3f, %d trajectories, %.2fs (train %.2fs, wait %.2fs)",
            self.step,
            version,
            values.get("rollout/reward", float("nan")),
            len(trajectories),
            step_time,
            phases.times.get("timing/train_step", 0.0),
            phases.times.get("timing/wait_batch", 0.0),
        )

        # An eval step saves too: the web app evaluates that checkpoint (rl_core.evaluate).
        if self.step % cfg.save_every == 0 or (cfg.eval_every and self.step % cfg.eval_every == 0):
            with phases.phase("checkpoint"):
                await self._checkpoint()
        return len(dropped_keys)

    async def _checkpoint(self) -> None:
        """Save this step. Asynchronous where the trainer can copy its state
        (``checkpoint_snapshot``, ``async_checkpoints``): the step waits for the copy, and the
        disk write goes on beside the next steps; the checkpoint is reported (and counts for a
        resume, ``rl_core.checkpoints``) only once it is complete."""
        if self.checkpoint_dir is None:
            return
        await self._checkpoint_written()  # one write at a time, in step order
        step, version = self.step, self.version
        counters = self.controller.counters() if self.controller is not None else None
        snapshot = getattr(self.trainer, "checkpoint_snapshot", None)
        started = time.perf_counter()
        save = (
            await asyncio.to_thread(snapshot)
            if self.cfg.async_checkpoints and snapshot is not None
            else None
        )
        if save is None:
            await self._write_checkpoint(self.trainer.save_checkpoint, step, version, counters)
            return
        logger.info("checkpoint of step %d copied in %.2fs", step, time.perf_counter() - started)
        self._writing = asyncio.create_task(self._write_checkpoint(save, step, version, counters))

    async def _checkpoint_written(self) -> None:
        """Wait for the asynchronous checkpoint being written, if any (raises if it failed)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            await writing

    async def _write_checkpoint(
        self,
        save: Callable[[str], object],
        step: int,
        version: int,
        counters: dict[str, int] | None,
    ) -> None:
        assert self.checkpoint_dir is not None
        started = time.perf_counter()
        path, size = await asyncio.to_thread(
            write_checkpoint,
            save,
            self.checkpoint_dir,
            step,
            version,
            keep=self.keep_checkpoints,
            counters=counters,
        )
        self.last_checkpoint, self._checkpoint_step = str(path), step
        await self.reporter.checkpoint(version, step, str(path), size)
        logger.info("checkpoint %s (%d bytes) in %.2fs", path, size, time.perf_counter() - started)


def rollout_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Loop-level rollout metrics: truncation, reward-function errors, mixed-version trajectories."""
    n = len(trajectories)
    if not n:
        return {}
    finish = [t.metadata.get("finish_reason") for t in trajectories]
    mixed = 0
    for t in trajectories:
        generated = {v for v, m in zip(t.versions, t.loss_mask, strict=True) if m}
        mixed += len(generated) > 1
    return {
        "rollout/truncated_frac": sum(f == "length" for f in finish) / n,
        "rollout/reward_error_frac": sum("reward_error" in t.metadata for t in trajectories) / n,
        "staleness/mixed_version_frac": mixed / n,
    }
