"""Load held (issue #16, item 4): 200 concurrent agent sessions against one web process.

Each agent loops through episodes as a real agent does (``bench/sessions_load.py``):
``/rl/start_session`` → k chat turns with the session key (the conversation grows) →
``/rl/set_reward`` → ``/rl/end_session``, against one uvicorn process serving Steep on the
embedded default (SQLite) and on PostgreSQL (+ Redis), with the zero-latency engine stand-in
(``bench/standin.py``) as its inference server. The client is aiohttp in several processes;
the same client against the stand-in's own ``/v1`` endpoints first shows its ceiling (what
it can drive when the server costs nothing), so that Steep's numbers are Steep's.

After each Steep cell the database is checked against what the client was answered, id by id:

- lost: a completion id acknowledged (2xx) with no turn row, or a session whose end was
  acknowledged that is not ended;
- duplicated: two rows for one turn of one session, an id answered twice, or a turn row no
  answer acknowledged (a request recorded twice would show here);
- 5xx: any 5xx answer (and every other non-2xx answer, by status).

It exits 1 when any of these is not zero. p50/p99 latency per endpoint are over the measured
window (after the warm-up).

    .venv/bin/python bench/load.py                          # 200 agents, k=3, both databases
    .venv/bin/python bench/load.py --database sqlite --duration 10

Files (databases, logs, results.json, report.md) go to ``.steep/bench/load-<time>/``;
everything started is stopped at the end. Results: docs/benchmarks/gateway.md ("Load held").
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import signal
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import PG_URL, REDIS_URL, RUNS, STEEP_PYTHON, Bench, log, machine  # noqa: E402
from bench.sessions_load import ENDPOINTS, LoadConfig, LoadResult, run_load  # noqa: E402
from tests.livestack import run_checked  # noqa: E402

CHECK = textwrap.dedent(
    """
    import json, os
    from django.db.models import Count
    from webapp.gateway.models import Interaction, Session
    acked = json.load(open(os.environ["LOAD_ACKNOWLEDGED"]))
    turns = int(os.environ["LOAD_TURNS"])
    rows = Interaction.objects.filter(session__one_turn=False)
    recorded = set(rows.values_list("id", flat=True))
    answered = set(acked["turn"])
    ended = Session.objects.filter(pk__in=acked["end"])
    print("CHECK", json.dumps({
        "acknowledged_turns": len(acked["turn"]),
        "turn_rows": len(recorded),
        "lost_turns": len(answered - recorded),
        "ids_answered_twice": len(acked["turn"]) - len(answered),
        "rows_never_answered": len(recorded - answered),
        "rows_duplicating_a_turn": rows.values("session_id", "turn").annotate(n=Count("id"))
            .filter(n__gt=1).count(),
        "acknowledged_ends": len(acked["end"]),
        "lost_ends": len(set(acked["end"])) - ended.filter(status=Session.Status.ENDED).count(),
        "ended_with_other_than_k_turns": ended.exclude(interaction_count=turns).count(),
    }))
    """
)


def check_rows(bench: Bench, env: dict, result: LoadResult, turns: int, name: str) -> dict:
    """The database of a Steep cell against the ids its client was answered."""
    path = bench.workdir / f"{name}-acknowledged.json"
    path.write_text(json.dumps(result.ids))
    out = run_checked(
        [str(STEEP_PYTHON), "manage.py", "shell", "-c", CHECK],
        env=env | {"LOAD_ACKNOWLEDGED": str(path), "LOAD_TURNS": str(turns)},
        what="checking the rows",
    )
    line = [x for x in out.splitlines() if x.startswith("CHECK ")][-1]
    return json.loads(line[len("CHECK ") :])


def problems(result: LoadResult, check: dict | None) -> dict:
    """What must be zero: lost, duplicated, 5xx, other errors."""
    fivexx = sum(n for status, n in result.statuses.items() if status.startswith("5"))
    out = {"5xx": fivexx, "other_errors": sum(result.errors.values()) - fivexx}
    if check is not None:
        out["lost"] = check["lost_turns"] + check["lost_ends"]
        out["duplicated"] = (
            check["ids_answered_twice"]
            + check["rows_never_answered"]
            + check["rows_duplicating_a_turn"]
        )
    return out


def cell(label: str, result: LoadResult, check: dict | None) -> dict:
    return {
        "target": label,
        "load": asdict(result) | {"ids": {k: len(v) for k, v in result.ids.items()}},
        "check": check,
        "problems": problems(result, check),
    }


def report(cells: list[dict], args) -> str:
    head = ["target", "episodes/s", "req/s"]
    for endpoint in ENDPOINTS:
        head += [f"{endpoint} p50", f"{endpoint} p99"]
    head += ["turns acked", "lost", "duplicated", "5xx", "other errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        load, p = c["load"], c["problems"]
        seconds = load["seconds"]
        row = [
            c["target"],
            f"{load['episodes'] / seconds:.1f}",
            f"{sum(load['requests'].values()) / seconds:.0f}",
        ]
        for endpoint in ENDPOINTS:
            row += [
                f"{load['p50_ms'].get(endpoint, 0):.1f} ms",
                f"{load['p99_ms'].get(endpoint, 0):.1f} ms",
            ]
        row += [
            str(load["acknowledged"].get("turn", 0)),
            str(p.get("lost", "—")),
            str(p.get("duplicated", "—")),
            str(p["5xx"]),
            str(p["other_errors"]),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="200 concurrent agent sessions against one web process."
    )
    p.add_argument("--agents", type=int, default=200, help="agents at once (default 200)")
    p.add_argument("--turns", type=int, default=3, help="chat turns per episode (default 3)")
    p.add_argument("--duration", type=float, default=20, help="seconds measured (default 20)")
    p.add_argument("--warmup", type=float, default=3, help="seconds of load before (default 3)")
    p.add_argument("--client-procs", type=int, default=3, help="client processes (default 3)")
    p.add_argument("--database", default="sqlite,postgres", help="sqlite, postgres or both")
    p.add_argument("--postgres-url", default=os.environ.get("BENCH_POSTGRES_URL", PG_URL))
    p.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", REDIS_URL))
    args = p.parse_args(argv)
    args.database = [d.strip() for d in args.database.split(",") if d.strip()]
    if set(args.database) - {"sqlite", "postgres"}:
        p.error("--database takes sqlite, postgres or sqlite,postgres")
    if min(args.agents, args.turns, args.client_procs) < 1:
        p.error("--agents, --turns and --client-procs take numbers of at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not STEEP_PYTHON.exists():
        print(f"{STEEP_PYTHON} is missing: set up Steep's venv first.", file=sys.stderr)
        return 2
    started = time.monotonic()
    workdir = RUNS / f"load-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    meta = machine()
    meta.update(
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        command="python bench/load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    bench_args = SimpleNamespace(
        workload="sessions", postgres_url=args.postgres_url, redis_url=args.redis_url
    )
    bench = Bench(bench_args, workdir)
    atexit.register(bench.processes.stop)

    def config(base: str, key: str) -> LoadConfig:
        return LoadConfig(
            base=base,
            key=key,
            agents=args.agents,
            turns=args.turns,
            duration=args.duration,
            warmup=args.warmup,
            procs=args.client_procs,
            collect_ids=True,
        )

    cells = []
    try:
        bench.start_standin()
        log(f"client ceiling: {args.agents} agents against the stand-in itself")
        result = run_load(config(f"{bench.standin_url}/v1", "standin"))
        cells.append(cell("client ceiling (stand-in, no Steep)", result, None))
        for database in args.database:
            log(f"Steep on {database} (load average {os.getloadavg()[0]:.2f})")
            with bench.steep_server(database, 1) as server:
                result = run_load(config(server.base, server.key))
            check = check_rows(bench, server.env, result, args.turns, server.name)
            cells.append(cell(server.label, result, check))
            log(f"  {check}")
    finally:
        bench.processes.stop()
    meta["wall_s"] = round(time.monotonic() - started)
    meta["loadavg_after"] = os.getloadavg()
    header = (
        f"Machine: {meta['cpus']} CPUs ({meta['cpu']}), Python {meta['python']}; {meta['date']}; "
        f"{args.agents} agents, {args.turns} turns per episode, aiohttp client in "
        f"{args.client_procs} processes; {args.duration:g} s measured after {args.warmup:g} s "
        f"warm-up; wall time {meta['wall_s']} s; load average before "
        f"{meta['loadavg_before'][0]:.2f}, after {meta['loadavg_after'][0]:.2f}."
    )
    text = header + "\n\n" + report(cells, args)
    print(text)
    (workdir / "results.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=2))
    (workdir / "report.md").write_text(text + "\n")
    log(f"results in {workdir.relative_to(ROOT)}/")
    bad = [c for c in cells if any(c["problems"].values())]
    for c in bad:
        print(f"NOT HELD: {c['target']}: {c['problems']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
