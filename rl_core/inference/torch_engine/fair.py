"""Which waiting requests join the running batch: a weighted fair share per run.

A shared pool serves many runs' adapters on one engine; first come, first served lets a
run that floods the pool fill the batch, and on a CPU (where every row and every prefill
lengthens the step) slow down every other run's tokens with it (``bench/pool.py``: 3.68x
another run's p50). So the waiting requests are kept per *tenant* (a run: the name of its
adapter without the ``-v<N>`` version, ``rl_core.inference.adapters``, and without the role
of a multi-agent run, whose roles share its one share and weight; the base model is the
tenant ``""``) and two rules pick who joins the batch:

* **Share.** While several tenants are active (a request running or waiting, or one within
  the last ``linger_steps`` scheduler steps: an agent's next turn follows its last answer
  after a moment, and the flood must not take the rows back in between), tenant ``i``
  holds at most ``max(1, floor(C · w_i / Σ_active w))`` rows of the batch of ``C`` =
  ``--max-running-requests``. A tenant alone gets the whole batch. The share is a cap,
  not lent out to others while its owner is idle: on a CPU latency isolation needs the
  batch to stay small, and a lent row cannot be taken back before it finishes.
* **Order.** Deficit round robin (Shreedhar & Varghese, SIGCOMM 1995) over the tenants'
  queues, one request costing 1 and a round giving each tenant its weight: with weights
  1 and 2 the second admits two requests per one of the first while both wait.

Within a tenant requests keep their arrival order. SGLang has no such scheduler, so on
SGLang the share comes from the gateway's per-run caps (``webapp.pools.limits``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator
from typing import Any

from rl_core.inference.adapters import adapter_version, run_of_prefix

BASE = ""  # the tenant of requests under no adapter


def tenant_of(lora_path: str | None) -> str:
    """The run an adapter name belongs to: ``<run>-v<N>`` and ``<run>-<role>-v<N>`` →
    ``<run>``; no adapter → ``""``."""
    if not lora_path:
        return BASE
    if adapter_version(lora_path) is None:
        return lora_path
    return run_of_prefix(lora_path.rsplit("-v", 1)[0])


class FairQueue:
    """The engine's waiting requests, per tenant; ``pick`` chooses those that join the batch.

    Not thread-safe: the engine guards it with its condition lock. Requests need
    ``lora_path`` (their tenant is read once, on ``append``).
    """

    def __init__(self, capacity: int, *, linger_steps: int = 64):
        self.capacity = capacity
        self.linger_steps = linger_steps
        self._picks = 0  # scheduler steps so far
        self._seen: dict[str, int] = {}  # tenant → the last step it had a request in the engine
        self.weights: dict[str, float] = {}  # tenant → weight; absent: 1
        # Round-robin order: a tenant served in a round moves to the end (dicts keep order).
        self._queues: dict[str, collections.deque[Any]] = {}
        self._deficit: dict[str, float] = {}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def set_weights(self, weights: dict[str, float]) -> None:
        for tenant, value in weights.items():
            if not value > 0 or math.isinf(value):
                raise ValueError(f"the weight of {tenant!r} must be a positive number, got {value}")
        self.weights = dict(weights)

    # ----- a deque's interface, as the engine used it

    def append(self, req: Any) -> None:
        req.tenant = tenant_of(req.lora_path)
        self._queues.setdefault(req.tenant, collections.deque()).append(req)
        self._deficit.setdefault(req.tenant, 0.0)

    def remove(self, req: Any) -> None:
        queue = self._queues[req.tenant]
        queue.remove(req)
        if not queue:
            self._drop(req.tenant)

    def clear(self) -> None:
        self._queues.clear()
        self._deficit.clear()

    def __iter__(self) -> Iterator[Any]:
        for queue in list(self._queues.values()):
            yield from queue

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __contains__(self, req: object) -> bool:
        queue = self._queues.get(getattr(req, "tenant", None) or BASE)
        return queue is not None and req in queue

    def depth(self) -> dict[str, int]:
        """Waiting requests per tenant."""
        return {tenant: len(q) for tenant, q in self._queues.items()}

    def _drop(self, tenant: str) -> None:
        # DRR: an emptied queue forfeits its deficit (no credit saved up while idle).
        del self._queues[tenant]
        self._deficit.pop(tenant, None)

    # ----- the choice

    def shares(self, running: collections.Counter[str]) -> dict[str, int]:
        """Rows of the batch each active tenant may hold (see the module docstring)."""
        present = {t for t, n in running.items() if n} | set(self._queues)
        for tenant in present:
            self._seen[tenant] = self._picks
        for tenant, seen in list(self._seen.items()):
            if self._picks - seen > self.linger_steps:
                del self._seen[tenant]
        active = set(self._seen)
        total = sum(self.weight(t) for t in active)
        return {t: max(1, math.floor(self.capacity * self.weight(t) / total)) for t in active}

    def pick(
        self, running: list[Any], may_join: Callable[[Any, list[Any]], bool] | None = None
    ) -> list[Any]:
        """Remove and return the waiting requests that join a batch now running ``running``.

        ``may_join(request, admitted)`` may refuse a request for reasons of its own (the
        adapters' ``--max-loras-per-batch``); its tenant then waits for the next step.
        """
        self._picks += 1
        counts = collections.Counter(getattr(r, "tenant", BASE) for r in running)
        shares = self.shares(counts)
        free = self.capacity - len(running)
        admitted: list[Any] = []
        blocked: set[str] = set()
        while free > 0:
            eligible = [t for t in self._queues if t not in blocked and counts[t] < shares[t]]
            if not eligible:
                break
            for tenant in eligible:
                if free == 0:
                    break
                queue, weight = self._queues[tenant], self.weight(tenant)
                if self._deficit[tenant] < 1:
                    self._deficit[tenant] += weight  # a new turn
                while queue and free > 0 and counts[tenant] < shares[tenant]:
                    if self._deficit[tenant] < 1:
                        break
                    if may_join is not None and not may_join(queue[0], admitted):
                        blocked.add(tenant)
                        break
                    admitted.append(queue.popleft())
                    counts[tenant] += 1
                    free -= 1
                    self._deficit[tenant] -= 1
                if not queue:
                    self._drop(tenant)
                elif tenant in blocked or counts[tenant] >= shares[tenant]:
                    # Held back by its share or the adapters: no credit piles up meanwhile.
                    self._deficit[tenant] = min(self._deficit[tenant], weight)
                    blocked.add(tenant)
                    self._queues[tenant] = self._queues.pop(tenant)
                elif self._deficit[tenant] < 1:  # its turn is over: to the end of the round
                    self._queues[tenant] = self._queues.pop(tenant)
                # else the batch filled up mid-turn: the tenant goes on first next step
        return admitted


class TokenRates:
    """Tokens generated per tenant over the last ``window_s`` seconds (one-second buckets):
    the per-run tokens/s of a pool's statistics. Scheduler thread writes, others read."""

    def __init__(self, window_s: int = 10):
        self.window_s = window_s
        self._buckets: collections.deque[tuple[int, collections.Counter[str]]] = collections.deque()

    def add(self, counts: collections.Counter[str], now: float) -> None:
        second = int(now)
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append((second, collections.Counter()))
            while self._buckets and self._buckets[0][0] <= second - self.window_s:
                self._buckets.popleft()
        self._buckets[-1][1].update(counts)

    def per_second(self, now: float) -> dict[str, float]:
        total: collections.Counter[str] = collections.Counter()
        for second, counts in list(self._buckets):
            if second > int(now) - self.window_s:
                total.update(counts)
        return {tenant: n / self.window_s for tenant, n in total.items()}
