"""Exported trajectories back in as a dataset (replay or SFT data).

An upload may be a run's trajectory export (``webapp.exports.trajectories``): JSON lines whose
``format`` is ``steep.trajectory.v1``, or the Parquet file of the same rows. Each such row
becomes one dataset row:

* ``messages``: the conversation up to the answer (the prompt a dataset run samples);
* ``answer``: the answer the conversation continued with (``completion``);
* ``metadata``: every other column as exported (token ids, logprobs, versions, rewards, ids,
  timestamps), with the export's ``metadata`` decoded as ``trajectory_metadata``.

So ``messages + [{"role": "assistant", "content": answer}]`` is the exported conversation and
the metadata holds the token-exact record. Other JSON lines pass through unchanged; every row
is then validated as any upload is (``validation.validate_lines``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

EXPORT_FORMAT = "steep.trajectory.v1"
PARQUET_MAGIC = b"PAR1"
_MARKER = EXPORT_FORMAT.encode()
_NOT_METADATA = {"format", "messages", "completion", "metadata"}


class UnreadableUpload(ValueError):
    """The upload looks like Parquet but pyarrow cannot read it."""


def dataset_row(exported: dict[str, Any]) -> dict[str, Any]:
    """One exported trajectory row as a dataset row (see the module's docstring)."""
    messages = list(exported.get("messages") or [])
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    raw = exported.get("metadata")
    try:
        decoded = json.loads(raw) if isinstance(raw, str) else (raw or {})
    except ValueError:
        decoded = {"raw": raw}
    metadata = {k: v for k, v in exported.items() if k not in _NOT_METADATA}
    metadata["trajectory_metadata"] = decoded
    return {
        "messages": messages,
        "answer": str(exported.get("completion") or ""),
        "metadata": metadata,
    }


def is_parquet(file) -> bool:
    if hasattr(file, "seek"):
        file.seek(0)
    head = file.read(len(PARQUET_MAGIC))
    if hasattr(file, "seek"):
        file.seek(0)
    return head == PARQUET_MAGIC


def _converted(lines: Iterable[bytes]) -> Iterator[bytes]:
    for raw in lines:
        if _MARKER in raw:
            try:
                row = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                yield raw  # validation reports it with its line number
                continue
            if isinstance(row, dict) and row.get("format") == EXPORT_FORMAT:
                yield json.dumps(dataset_row(row), ensure_ascii=False).encode()
                continue
        yield raw


def _parquet_lines(file) -> Iterator[bytes]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise UnreadableUpload(f"not a readable Parquet file ({exc})") from None
    for index in range(parquet.num_row_groups):
        for row in parquet.read_row_group(index).to_pylist():
            if row.get("format") == EXPORT_FORMAT:
                row = dataset_row(row)
            yield json.dumps(row, ensure_ascii=False).encode()


def upload_lines(file) -> Iterator[bytes]:
    """The rows of an upload (JSONL, or Parquet by its magic bytes) as JSON lines, exported
    trajectories turned into dataset rows; read one line or one row group at a time."""
    if is_parquet(file):
        yield from _parquet_lines(file)
        return
    if hasattr(file, "seek"):
        file.seek(0)
    yield from _converted(file)
