"""The demo ``./steep up`` shows: how its dataset run's reward rises, and how fast.

    .venv/bin/python bench/demo_curve.py [--json out.json] [--every 10]

Starts Steep as ``./steep up`` does (a fresh DATA_DIR and SQLite database under
.steep/bench/: migrate, the tiny model, ``bootstrap_demo --start``, then a Celery worker
with beat and uvicorn; so the online demo run and the built-in demo agent run beside it),
waits for the dataset demo run to complete, and prints its ``rollout/reward`` curve with
the wall time of each step since the run turned running, plus how far the online run got.
Everything it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.livestack import LiveStack, answers, free_port, steep_env, wait_for  # noqa: E402


def series(rest: httpx.Client, run_id: str, name: str) -> list[dict]:
    points, page = [], f"/runs/{run_id}/metrics/?name={name}&page_size=500"
    while page:
        body = rest.get(page).json()
        points += body["results"]
        page = body["next"]
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--every", type=int, default=10, help="print every Nth step")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()

    work = ROOT / ".steep" / "bench" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    data_dir = work / "data"
    data_dir.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = steep_env(data_dir=data_dir, site_url=url, local_ray=True)
    with LiveStack(env=env, log_dir=work) as stack:
        model = data_dir / "models" / "tiny-chat"
        stack.manage("migrate", "--noinput", "-v0")
        subprocess.run([sys.executable, "-m", "rl_core.tiny", str(model)], env=env, check=True)
        stack.manage("bootstrap_demo", "--start", "--model", str(model))
        stack.start_worker()
        web = stack.start_web(port)
        stack.wait_ready(web, lambda: answers(f"{url}/login/"), what="the web server")
        demo = dict(re.findall(r"^export (\w+)=(.*)$", (data_dir / "demo.env").read_text(), re.M))
        rest = httpx.Client(
            base_url=f"{url}/api/v1",
            headers={"Authorization": f"Bearer {demo['STEEP_KEY']}"},
            timeout=30,
        )
        dataset_run = next(
            r for r in rest.get("/runs/").json()["results"] if r["mode"] == "dataset"
        )
        run_id = dataset_run["id"]
        wait_for(
            lambda: rest.get(f"/runs/{run_id}/").json()["status"] in ("completed", "failed"),
            args.timeout,
            f"the dataset demo run to finish\n{stack.log_tail()}",
            interval=5,
        )
        run = rest.get(f"/runs/{run_id}/").json()
        online = rest.get(f"/runs/{demo['STEEP_RUN']}/").json()
        rewards = series(rest, run_id, "rollout/reward")
        rest.close()

    started = datetime.fromisoformat(run["started_at"])
    curve = [
        {
            "step": p["step"],
            "seconds": round((datetime.fromisoformat(p["created_at"]) - started).total_seconds()),
            "reward": round(p["value"], 3),
        }
        for p in sorted(rewards, key=lambda p: p["step"])
    ]
    print(f"dataset demo run: {run['status']}, {run['step']} steps")
    print("| step | s since running | rollout/reward (mean of 10 steps around) |")
    print("|---:|---:|---:|")
    for i, point in enumerate(curve):
        if point["step"] % args.every == 0 or i == len(curve) - 1:
            window = [p["reward"] for p in curve[max(0, i - 5) : i + 5]]
            print(f"| {point['step']} | {point['seconds']} | {statistics.mean(window):.2f} |")
    print(f"online demo run: {online['status']} at step {online['step']}")
    if args.json:
        args.json.write_text(json.dumps({"run": run, "online": online, "curve": curve}, indent=2))


if __name__ == "__main__":
    main()
