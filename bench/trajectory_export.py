"""Trajectory export: throughput and peak memory of the JSONL and Parquet streams.

Fills a fresh SQLite database (under .steep/bench/) with N one-turn sessions of a run
(PROMPT prompt tokens, GEN generated tokens each), then consumes
``webapp.exports.trajectories`` exactly as the export view streams it, measuring rows/s,
bytes, and the peak of Python allocations (tracemalloc) while streaming. Peak memory that
does not grow with N is the point: a run of any size streams in bounded memory.

    .venv/bin/python bench/trajectory_export.py --sessions 1000,4000 [--database-url postgres://...]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def setup(data_dir: Path, database_url: str = "") -> None:
    os.environ["DATA_DIR"] = str(data_dir)
    os.environ["DJANGO_SETTINGS_MODULE"] = "webapp.settings"
    os.environ.pop("DATABASE_URL", None)
    if database_url:  # an empty database: the bench fills it
        os.environ["DATABASE_URL"] = database_url
    import django
    from django.core.management import call_command

    django.setup()
    from django.conf import settings

    settings.DEBUG = False  # DEBUG keeps every query's SQL: not what is measured
    call_command("migrate", verbosity=0)


def fill(n: int, prompt: int, gen: int):
    from django.contrib.auth import get_user_model

    from rl_core.config import RunConfig
    from webapp.accounts.services import project_create
    from webapp.gateway.models import Interaction, Session
    from webapp.runs.services import run_create

    user = get_user_model().objects.create_user(username=f"bench{n}", password="x-long-pass-9")
    project = project_create(owner=user, name=f"bench-{n}")
    run = run_create(
        project=project,
        name="bench",
        config=RunConfig.from_dict({"base_model": "m", "mode": "online"}),
        dataset=None,
    )
    sessions = [
        Session(project=project, run=run, status="ended", trajectory="ready", interaction_count=1)
        for _ in range(n)
    ]
    Session.objects.bulk_create(sessions, batch_size=500)
    turns = []
    rng = random.Random(0)  # varied tokens and logprobs, as real ones: Parquet cannot fold them
    for i, session in enumerate(sessions):
        out = {
            "output_ids": [rng.randrange(32000) for _ in range(gen)],
            "logprobs": [round(-rng.expovariate(2.0), 6) for _ in range(gen)],
            "versions": [3] * gen,
            "finish_reason": "stop",
            "text": "answer " * (gen // 7),
        }
        turns.append(
            Interaction(
                id=f"chatcmpl-{n}-{i:09d}",
                session=session,
                turn=0,
                request_hash="",
                messages=[{"role": "user", "content": "question " * (prompt // 9)}],
                input_ids=[rng.randrange(32000) for _ in range(prompt)],
                outputs=[out],
                response={},
                reward=1.0,
            )
        )
    Interaction.objects.bulk_create(turns, batch_size=500)
    return run


def measure(run, fmt: str) -> dict:
    """One timed pass, then one under tracemalloc (which slows allocation) for the peak."""
    from webapp.exports.trajectories import export_rows, jsonl_chunks, parquet_chunks

    chunks = jsonl_chunks if fmt == "jsonl" else parquet_chunks
    start = time.perf_counter()
    size = sum(len(chunk) for chunk in chunks(export_rows(run=run)))
    elapsed = time.perf_counter() - start
    tracemalloc.start()
    for _ in chunks(export_rows(run=run)):
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": elapsed, "bytes": size, "peak_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", default="1000,4000")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument(
        "--database-url", default="", help="an empty PostgreSQL database (default: SQLite)"
    )
    args = parser.parse_args()
    data_dir = ROOT / ".steep" / "bench" / f"export-{time.strftime('%Y%m%d-%H%M%S')}"
    data_dir.mkdir(parents=True)
    setup(data_dir, args.database_url)
    print("| sessions | format | rows/s | MB written | MB/s | peak Python MiB |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.sessions.split(",")):
        run = fill(n, args.prompt_tokens, args.gen_tokens)
        for fmt in ("jsonl", "parquet"):
            r = measure(run, fmt)
            print(
                f"| {n} | {fmt} | {n / r['seconds']:.0f} | {r['bytes'] / 1e6:.1f} | "
                f"{r['bytes'] / 1e6 / r['seconds']:.1f} | {r['peak_mib']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
