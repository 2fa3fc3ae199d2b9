"""The names of a LoRA run's adapters on its inference servers (no torch: the gateway uses it).

A LoRA run publishes policy version ``N`` as an adapter named ``<prefix>-v<N>`` (the
prefix is the run's id), loaded beside the base model (``rl_core.adapter_sync``). Callers
send that name as ``lora_path`` on ``/generate``; the client tags the tokens generated
under it with version ``N``. Version 0 of a run that starts from the base model is the
base model itself (a fresh adapter has ``B = 0``), so no adapter is named for it.

``AdapterSwitch`` moves a run's requests in flight onto each new version as it is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from rl_core.config import ROLE_NAME

logger = logging.getLogger(__name__)

_NAME = re.compile(r"-v(\d+)$")
# A multi-agent run's role prefix, ``<run id>-<role>``: the run id is a UUID, so the role
# starts after its twelve-digit last group.
_ROLE_PREFIX = re.compile(
    r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})-" + ROLE_NAME.pattern
)


def adapter_name(prefix: str, version: int) -> str:
    return f"{prefix}-v{int(version)}"


def role_prefix(prefix: str, role: str = "") -> str:
    """The adapter prefix of one role of a multi-agent run (``<run>-<role>``; its versions
    are ``<run>-<role>-v<N>``); a one-policy run (role "") keeps the run's prefix."""
    return f"{prefix}-{role}" if role else prefix


def run_of_prefix(prefix: str) -> str:
    """The run an adapter prefix belongs to: ``<run id>-<role>`` → ``<run id>``; any other
    prefix is its own (a one-policy run's prefix is its id)."""
    match = _ROLE_PREFIX.fullmatch(prefix)
    return match.group(1) if match else prefix


def adapter_version(name: str | None) -> int | None:
    """``N`` of an adapter named ``<prefix>-v<N>``; None for any other name."""
    match = _NAME.search(name or "")
    return int(match.group(1)) if match else None


def current_adapter(
    prefix: str, version: int, *, lora_rank: int, init_checkpoint: str | None = None
) -> str | None:
    """The ``lora_path`` new requests of a run send at policy ``version``: None for a full
    fine-tuning run, and for version 0 of a LoRA run that starts from the base model."""
    if not lora_rank or (int(version) == 0 and not init_checkpoint):
        return None
    return adapter_name(prefix, version)


def move_lag(max_staleness: int) -> int:
    """How many versions behind an answer's adapter may fall before ``AdapterSwitch`` moves it.

    Only the tokens of an answer's last ``max_staleness`` versions train, and each move costs a
    prefill of the whole context, so moving at every version pays for tokens that go stale
    anyway. Half the staleness bound trained the most in the cluster simulation (AReaL's
    setting: lag 2 of 4 gave 60.6k tokens/s against 57.8k moving at every version and 51.0k
    never; lag 4 of 8 89.3k against 77.3k and 75.0k; docs/benchmarks/async.md).
    """
    return max(1, int(max_staleness) // 2)


class AdapterSwitch:
    """A LoRA run's generations in flight, so that each new adapter version takes them over.

    A request keeps the adapter it was sent with (SGLang's ``lora_path`` is per request), so
    without this every token of a long answer carries its start version and, once that is
    more than ``max_staleness`` versions old, the whole answer is masked out of the loss. A
    full-weight update does not have that problem: the servers pause in place and the tokens
    after it carry the new version. ``AdapterSync`` calls ``switch(name)`` once version N is
    loaded on every server: each request still generating under an older adapter is aborted
    (``/abort_request`` by its rid) and the client's resume loop sends the rest of it under
    ``name``, so the tokens after the switch are version N's (generated and tagged). The price
    is a prefill of the context so far per moved request, so a request is moved only once its
    adapter is ``lag`` versions behind (``move_lag``); requests under other runs' adapters, on
    a shared pool, are not touched. Best effort: a request sent an instant before the switch
    may reach its server after the abort and finish under its old adapter, as it would
    without the switch.
    """

    def __init__(self, lag: int = 1) -> None:
        if lag < 1:
            raise ValueError("AdapterSwitch moves requests at least one version behind (lag >= 1)")
        self.lag = lag  # a request is moved once its adapter is this many versions behind
        self.current: str | None = None  # the newest adapter loaded on every server
        self.switched = 0  # requests moved onto a newer adapter over the run
        self._in_flight: dict[str, tuple[Any, str | None]] = {}  # rid -> (client, lora_path)

    def _behind(self, lora_path: str | None) -> int:
        """Versions between ``lora_path`` and the current adapter (the base model is 0)."""
        return (adapter_version(self.current) or 0) - (adapter_version(lora_path) or 0)

    def newer(self, lora_path: str | None) -> str | None:
        """The adapter a segment sent under ``lora_path`` should use instead; None: keep it."""
        if self.current is None or self._behind(lora_path) <= 0:
            return None
        return self.current

    def track(self, rid: str, client: Any, lora_path: str | None) -> None:
        self._in_flight[rid] = (client, lora_path)

    def untrack(self, rid: str) -> None:
        self._in_flight.pop(rid, None)

    async def switch(self, name: str) -> int:
        """``name`` is loaded everywhere: move the requests ``lag`` versions behind onto it;
        return how many were asked to move."""
        self.current = name
        moving = [
            (rid, client)
            for rid, (client, path) in self._in_flight.items()
            if self._behind(path) >= self.lag
        ]
        results = await asyncio.gather(
            *(client.abort_request(rid) for rid, client in moving), return_exceptions=True
        )
        moved = 0
        for (rid, _), result in zip(moving, results, strict=True):
            if isinstance(result, BaseException):  # it ends under its old adapter
                logger.debug("could not move %s onto %s: %r", rid, name, result)
            else:
                moved += 1
        self.switched += moved
        return moved
