"""A run's trajectories as rows to take away: JSON lines or Parquet, one fixed schema.

Every row has the same keys and types (``SCHEMA``), so ``datasets.load_dataset("json" |
"parquet", data_files=...)`` infers one table whatever the sessions hold:

* what was said: ``messages`` (the last turn's messages and the answer the conversation
  continued with, each ``{"role", "content"}`` with content as text; the token ids below are
  the exact record), ``completion`` (that answer's text);
* what was trained on: ``input_ids``, ``loss_mask``, ``logprobs``, ``versions`` (the policy
  version of each generated token; -1 for prompt tokens), ``temperatures`` (the one each
  logprob was taken at), ``turn_ends``, ``rewards`` (one per assistant turn) and ``reward``
  (their sum);
* where it came from: ``run_id``, ``session_id`` (``<id>#k`` when a session split into
  several sequences), ``agent_id``, ``task_id``, ``group_id``, ``role`` (the role whose turns
  a multi-agent run's trajectory trains; "" otherwise), ``status`` (the session's),
  ``trajectory`` (its training state), ``created_at`` / ``ended_at`` (ISO 8601), and
  ``metadata`` (a JSON object encoded as a string: its keys differ from row to row).

Rows are built from ``webapp.gateway.selectors.session_trajectories``, the trainer's own view
of a session, reading sessions in chunks: a run of any size streams in bounded memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson
from django.db.models import Prefetch, Q

from webapp.exports.zipstream import ChunkSink
from webapp.gateway.models import Interaction, Session
from webapp.gateway.selectors import session_trajectories
from webapp.runs.models import Run

FORMATS = ("jsonl", "parquet")
CONTENT_TYPES = {"jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}
PARQUET_ROWS_PER_GROUP = 200
EXPORT_FORMAT = "steep.trajectory.v1"

# (name, arrow type as text): pyarrow is imported only when Parquet is asked for.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("format", "string"),
    ("run_id", "string"),
    ("session_id", "string"),
    ("agent_id", "string"),
    ("task_id", "string"),
    ("group_id", "string"),
    ("role", "string"),
    ("status", "string"),
    ("trajectory", "string"),
    ("created_at", "string"),
    ("ended_at", "string"),
    ("messages", "messages"),
    ("completion", "string"),
    ("input_ids", "list<int64>"),
    ("loss_mask", "list<int64>"),
    ("logprobs", "list<double>"),
    ("versions", "list<int64>"),
    ("temperatures", "list<double>"),
    ("turn_ends", "list<int64>"),
    ("rewards", "list<double>"),
    ("reward", "double"),
    ("metadata", "string"),
)


def message_text(content: Any) -> str:
    """A message's content as text: a string as it is, content parts' texts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") if isinstance(part, dict) else str(part) for part in content
        )
    return "" if content is None else json.dumps(content)


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def _row(run: Run, session: Session, trajectory, turns: dict[str, Interaction]) -> dict:
    last = turns.get((trajectory.metadata.get("interactions") or [None])[-1])
    messages = [
        {"role": str(m.get("role", "")), "content": message_text(m.get("content"))}
        for m in (last.messages if last is not None else [])
        if isinstance(m, dict)
    ]
    completion = ""
    if last is not None and last.outputs:
        chosen = last.outputs[min(last.chosen, len(last.outputs) - 1)]
        completion = str(chosen.get("text") or "")
        messages.append({"role": "assistant", "content": completion})
    n = len(trajectory.input_ids)
    spans = trajectory.turn_spans()
    return {
        "format": EXPORT_FORMAT,
        "run_id": str(run.id),
        "session_id": trajectory.session_id,
        "agent_id": str(session.agent_id) if session.agent_id else None,
        "task_id": session.task_id,
        "group_id": trajectory.group_id,
        "role": trajectory.role,
        "status": session.status,
        "trajectory": session.trajectory,
        "created_at": _iso(session.created_at),
        "ended_at": _iso(session.ended_at),
        "messages": messages,
        "completion": completion,
        "input_ids": list(trajectory.input_ids),
        "loss_mask": list(trajectory.loss_mask),
        "logprobs": [float(x) for x in trajectory.logprobs],
        "versions": list(trajectory.versions),
        "temperatures": [float(x) for x in (trajectory.temperatures or [1.0] * n)],
        "turn_ends": [end for _, end in spans],
        "rewards": [float(x) for x in trajectory.rewards],
        "reward": float(sum(trajectory.rewards)),
        "metadata": json.dumps(trajectory.metadata, sort_keys=True),
    }


def export_rows(*, run: Run, status: str | None = None, chunk_size: int = 100) -> Iterator[dict]:
    """Every trajectory of ``run`` as a row of ``COLUMNS``, oldest session first.

    ``status`` is a session status or a trajectory state, as in ``session_list``.
    """
    sessions = (
        Session.objects.filter(project_id=run.project_id, run=run)
        .prefetch_related(Prefetch("interactions", queryset=Interaction.objects.order_by("turn")))
        .order_by("created_at", "id")
    )
    if status:
        sessions = sessions.filter(Q(status=status) | Q(trajectory=status))
    for session in sessions.iterator(chunk_size=chunk_size):
        interactions = list(session.interactions.all())
        # Each prefetched turn points back at its session: drop the cache so a chunk is
        # freed as soon as it is exported, not at the next cycle collection (measured:
        # peak memory then stays flat as the run grows, bench/trajectory_export.py).
        session._prefetched_objects_cache.clear()
        try:
            trajectories = session_trajectories(session, interactions)
        except ValueError:  # a malformed recording must not cut the export short
            continue
        turns = {turn.id: turn for turn in interactions}
        for trajectory in trajectories:
            yield _row(run, session, trajectory, turns)


def jsonl_chunks(rows: Iterator[dict]) -> Iterator[bytes]:
    for row in rows:
        yield orjson.dumps(row) + b"\n"  # ~10x json.dumps on long token lists


def arrow_schema():
    import pyarrow as pa

    simple = {
        "string": pa.string(),
        "double": pa.float64(),
        "list<int64>": pa.list_(pa.int64()),
        "list<double>": pa.list_(pa.float64()),
        "messages": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    }
    return pa.schema([(name, simple[kind]) for name, kind in COLUMNS])


def parquet_chunks(
    rows: Iterator[dict], rows_per_group: int = PARQUET_ROWS_PER_GROUP
) -> Iterator[bytes]:
    """``rows`` as one Parquet file, a row group at a time (memory: one group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema()
    sink = ChunkSink()
    writer = pq.ParquetWriter(pa.PythonFile(sink, mode="w"), schema)
    batch: list[dict] = []

    def flush() -> bytes:
        writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        batch.clear()
        return sink.take()

    for row in rows:
        batch.append(row)
        if len(batch) >= rows_per_group:
            yield flush()
    if batch:
        yield flush()
    writer.close()
    yield sink.take()
