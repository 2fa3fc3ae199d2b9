"""Ids for rows and requests: random version-4 UUIDs from a per-process generator."""

from __future__ import annotations

import os
import uuid

from rl_core.ids import new_hex, new_uuid


def test_ids_are_version_4_uuids_and_unique():
    ids = [new_uuid() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(u.version == 4 and u.variant == uuid.RFC_4122 for u in ids)
    assert all(len(h) == 32 and uuid.UUID(h).version == 4 for h in (new_hex() for _ in range(100)))


def test_a_forked_child_does_not_repeat_the_parents_ids():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then exit without running pytest's handlers
        os.write(write, new_hex().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 32
    assert child != new_hex()  # without the reseed, the child draws what the parent draws next
