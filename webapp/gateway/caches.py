"""What one web process keeps between gateway requests, in one place.

Nothing here is the truth: each entry is rebuilt from the database or from disk when it
is missing, so a process may drop them at any time (``clear``, used by tests).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# A run's serving servers are re-read at most every SERVERS_TTL_S (and at once after a
# failure here): the list changes when servers are attached, stopped or marked down, rarely.
SERVERS_TTL_S = 1.0


@dataclass
class GatewayCaches:
    # base model → its chat tokenizer (rl_core.chat.ChatTokenizer), loaded once.
    tokenizers: dict[str, Any] = field(default_factory=dict)
    # (event loop id, server url) → a pooled HTTP client: clients are bound to their loop.
    clients: dict[tuple[int, str], Any] = field(default_factory=dict)
    # run id → (expiry on the monotonic clock, [(url, healthy)]).
    servers: dict[object, tuple[float, list[tuple[str, bool, str]]]] = field(default_factory=dict)
    # (event loop id, run id) → the read of the server list in flight (single flight).
    server_reads: dict[tuple[int, object], asyncio.Future] = field(default_factory=dict)
    # server url → requests this process has in flight there: new sessions go to the least loaded.
    in_flight: Counter[str] = field(default_factory=Counter)

    def clear(self) -> None:
        for entries in (
            self.tokenizers,
            self.clients,
            self.servers,
            self.server_reads,
            self.in_flight,
        ):
            entries.clear()


CACHES = GatewayCaches()
