"""Simulated time for asyncio: an event loop whose clock jumps instead of waiting.

``SimEventLoop`` is an ordinary selector event loop whose ``time()`` is a virtual clock.
When no callback is ready and no I/O is pending, it advances the clock straight to the
next timer instead of sleeping, so ``asyncio.sleep(30)`` returns at once with
``loop.time()`` 30 s later. Any asyncio program (here: Steep's own rollout driver,
training loop and weight sync against in-process stand-ins) then runs as fast as its
Python code allows, and what it measures with ``loop.time()`` is simulated time: the
same for the same seed on any machine, however loaded (wall-clock thresholds would not be).

Work the code under test hands to a thread (``asyncio.to_thread``: the loop's
``train_step``, ``save_weights``, the trainer's broadcast) runs inline instead, and the
stand-in says how long it would have taken with ``charge(seconds)``; the awaiting
coroutine resumes that much simulated time later while everything else keeps running.
A program that waits on a real thread or a real socket would stall the clock, so the
stand-ins talk over in-process transports only.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; an idle wait advances the owning loop's clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: SimEventLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            # Nothing scheduled at all: only another thread could wake the loop (call_soon_threadsafe).
            return super().select(None)
        assert self.loop is not None
        self.loop.advance(timeout)
        return []


class SimEventLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time (see the module docstring); ``now`` starts at 0."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0
        self._charged: float | None = None
        # Timers due within this much of now fire together; far below any simulated duration.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the selector calls this when the loop would wait)."""
        if seconds > 0:
            self._now += seconds

    def charge(self, seconds: float) -> None:
        """The executor call running now takes ``seconds`` of simulated time (``charge``)."""
        if self._charged is None:
            raise RuntimeError("charge() is only meaningful inside run_in_executor / to_thread")
        self._charged += max(0.0, float(seconds))

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """Run ``func`` now, on the loop's thread; its result arrives after the time it charged."""
        future: asyncio.Future[T] = self.create_future()
        outer, self._charged = self._charged, 0.0
        try:
            result = func(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            delay, self._charged = self._charged, outer
            self.call_later(delay, _settle, future, None, exc)
        else:
            delay, self._charged = self._charged, outer
            self.call_later(delay, _settle, future, result, None)
        return future


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # the awaiting coroutine was cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def charge(seconds: float) -> None:
    """Inside a stand-in's blocking method (called through ``to_thread``): it takes ``seconds``.

    Outside a ``SimEventLoop`` (the stand-in used with a real loop) this is a no-op.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    if isinstance(loop, SimEventLoop):
        loop.charge(seconds)


def run_simulated(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh ``SimEventLoop``: ``main`` runs in simulated time."""
    loop = SimEventLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
