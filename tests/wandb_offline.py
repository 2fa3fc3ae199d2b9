"""Reads a W&B offline run back: the records of its ``run-<id>.wandb`` file, parsed with
wandb's own protobuf (``wandb_internal_pb2.Record``).

wandb 0.31 has no Python reader of its transaction log any more (its Go core writes and syncs
it), so the framing is read here: the LevelDB log format that file uses, after a 7-byte header
(``:W&B``, a magic number, a version). The file is cut into 32 KiB blocks; each chunk of a
record has a 7-byte header (a checksum, a little-endian 2-byte length, a type: 1 whole, 2
first, 3 middle, 4 last), and a block's last bytes, too few for a header, are padding.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FILE_HEADER = 7
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pending, pos = [], b"", FILE_HEADER
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left_in_block
            continue
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def offline_runs(wandb_dir: Path) -> list[Path]:
    """The transaction logs of the offline runs under a ``wandb.init(dir=...)``, oldest first."""
    return sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))


def history(wandb_dir: Path) -> dict[int, dict]:
    """Each logged step's values, over every offline run of the directory (a resumed run
    writes another)."""
    steps: dict[int, dict] = {}
    for path in offline_runs(wandb_dir):
        for record in records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            values = {
                item.key or ".".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            steps.setdefault(record.history.step.num, {}).update(values)
    return steps


def config(wandb_dir: Path) -> dict:
    """The run's config as logged (its last value per key)."""
    found = {}
    for path in offline_runs(wandb_dir):
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind in ("run", "config"):  # wandb.init's config is in the run record
                updates = record.run.config.update if kind == "run" else record.config.update
                for item in updates:
                    found[item.key or ".".join(item.nested_key)] = json.loads(item.value_json)
    return found


def artifacts(wandb_dir: Path) -> list:
    return [
        record.artifact
        for path in offline_runs(wandb_dir)
        for record in records(path)
        if record.WhichOneof("record_type") == "artifact"
    ]
