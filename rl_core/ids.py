"""Unique ids without a system call per id.

``uuid.uuid4()`` reads 16 bytes from the operating system for every id. On the gateway's
event loop that call releases the GIL, and taking it back waits for whichever thread has it
meanwhile (the lane's database thread): under 200 agents, a profile of the web process had
~5% of its samples in ``uuid4``. The ids made here must be unique, not secret (keys and
tokens come from ``secrets``), so they are drawn from a per-process generator seeded from the
operating system, and reseeded in a forked child so that two processes never share a stream.
"""

from __future__ import annotations

import os
import random
import uuid

_generator = random.Random()


def _reseed() -> None:
    _generator.seed(os.urandom(32))


_reseed()
os.register_at_fork(after_in_child=_reseed)


def new_uuid() -> uuid.UUID:
    """A random version-4 UUID (122 random bits, as ``uuid.uuid4()``)."""
    return uuid.UUID(int=_generator.getrandbits(128), version=4)


def new_hex() -> str:
    """``new_uuid().hex``: 32 lowercase hex digits."""
    return new_uuid().hex
