"""Training runs through the real job path: max_staleness 0 vs 4, or one backend against another.

    .venv/bin/python bench/e2e.py [--steps 30] [--staleness 0,4] [--backends torch]
        [--task toy|demo] [--model tiny|tiny32] [--json out.json]

Starts a private Steep (fresh DATA_DIR and SQLite database under .steep/bench/,
uvicorn, a Celery worker with beat, a local Ray head on free ports), then for each
inference backend and max_staleness creates a dataset-mode run of the toy task
(rl_core.toy, TOY_SETTINGS) or of the demo's (DEMO_SETTINGS, what ``./steep up`` trains)
through the REST API, starts it, and measures while it runs (``--model tiny32``: the tiny
model at head size 32, which vLLM's CPU attention needs; the demo's own has 8):

- trajectories trained per second: sessions marked trained ÷ (finished_at − started_at);
- time per weight update: mean of the job's ``timing/weight_sync`` metric (save → pause
  → update_weights_from_disk → continue);
- inference utilisation: the torch engine's ``busy_seconds`` (time inside prefill/decode
  steps, from ``/get_server_info``) over the wall time it was sampled (not for vLLM);
- the reward curve: ``rollout/reward`` per step with its wall time since the run started.
Everything it starts is stopped at the end; results go to stdout (markdown) and --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.livestack import bench_instance  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staleness", default="0,4")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--backends", default="torch", help="inference_backend of each run")
    parser.add_argument("--task", default="toy", choices=("toy", "demo"))
    parser.add_argument("--model", default="tiny", choices=("tiny", "tiny32"))
    args = parser.parse_args()
    from rl_core.tiny import build_tiny_model
    from rl_core.toy import DEMO_SETTINGS, TOY_SETTINGS, demo_rows, toy_rows

    task, rows = (TOY_SETTINGS, toy_rows) if args.task == "toy" else (DEMO_SETTINGS, demo_rows)
    shape = {"hidden": 64, "heads": 2, "kv_heads": 1} if args.model == "tiny32" else {}

    results = []
    with bench_instance("e2e") as instance:
        rest = instance.rest()
        # Under the instance's model root (DATA_DIR/models): runs may name only what it offers.
        model = build_tiny_model(instance.data_dir / "models" / "tiny-chat", **shape)
        env = instance.stack.env or {}
        body = "".join(json.dumps(row) + "\n" for row in rows(256)).encode()
        dataset = rest.post(
            "/datasets/", data={"name": "toy"}, files={"file": ("toy.jsonl", body)}
        ).json()
        for backend in args.backends.split(","):
            for staleness in [int(s) for s in args.staleness.split(",")]:
                results.append(
                    measure(rest, env, dataset["id"], model, staleness, args.steps, task, backend)
                )
    print(table(results, args.steps))
    if len(results) == 2 and results[0]["trajectories_per_s"]:
        print(
            f"\nasync/sync trajectories per second: {results[1]['trajectories_per_s'] / results[0]['trajectories_per_s']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def measure(
    rest, env, dataset_id, model, staleness: int, steps: int, task: dict, backend: str
) -> dict:
    settings = {
        **task,
        "max_staleness": staleness,
        "max_steps": steps,
        "save_every": steps,
        "inference_backend": backend,
    }
    created = rest.post(
        "/runs/",
        json={
            "name": f"{backend}-staleness-{staleness}",
            "mode": "dataset",
            "base_model": str(model),
            "dataset": dataset_id,
            **settings,
        },
    )
    if created.status_code != 201:
        raise SystemExit(f"the run was refused: {created.text}")
    run = created.json()
    rest.post(f"/runs/{run['id']}/start/")
    samples: list[tuple[float, float]] = []  # (time, engine busy_seconds)
    database = Path(env["DATA_DIR"]) / "steep.sqlite3"
    while True:
        state = rest.get(f"/runs/{run['id']}/").json()
        if state["status"] in ("completed", "failed", "stopped"):
            break
        for url in _servers(database, run["id"]):
            try:
                info = httpx.get(f"{url}/get_server_info", timeout=5).json()
                samples.append((time.monotonic(), info["internal_states"][0]["busy_seconds"]))
            except (httpx.HTTPError, KeyError, IndexError):
                pass
        time.sleep(1.0)
    if state["status"] != "completed":
        raise SystemExit(
            f"run staleness-{staleness} ended {state['status']}: {state['error'][:2000]}"
        )
    from datetime import datetime

    wall = (
        datetime.fromisoformat(state["finished_at"]) - datetime.fromisoformat(state["started_at"])
    ).total_seconds()
    trained = rest.get(
        "/sessions/", params={"run": run["id"], "status": "trained", "page_size": 1}
    ).json()["count"]
    sync = [p["value"] for p in _metric(rest, run["id"], "timing/weight_sync")]
    reward_points = sorted(_metric(rest, run["id"], "rollout/reward"), key=lambda p: p["step"])
    rewards = [p["value"] for p in reward_points]
    began = datetime.fromisoformat(state["started_at"])
    curve = [
        (p["step"], p["value"], (datetime.fromisoformat(p["created_at"]) - began).total_seconds())
        for p in reward_points
        if p.get("created_at")
    ]
    utilisation = (
        (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])
        if len(samples) > 1
        else float("nan")
    )
    mismatch = {
        name: statistics.mean(p["value"] for p in points)
        for name in CORRECTION_METRICS
        if (points := _metric(rest, run["id"], name))
    }
    return {
        "backend": backend,
        "serving_dtype": env.get("STEEP_VLLM_CPU_DTYPE", "float32")
        if backend == "vllm"
        else "float32",
        "mismatch": mismatch,
        "reward_curve": curve,
        "max_staleness": staleness,
        "steps": steps,
        "wall_s": wall,
        "trajectories_trained": trained,
        "trajectories_per_s": trained / wall if wall else 0.0,
        "weight_update_s": statistics.mean(sync) if sync else float("nan"),
        "inference_utilisation": utilisation,
        "reward_first5": statistics.mean(rewards[:5]) if rewards else float("nan"),
        "reward_last5": statistics.mean(rewards[-5:]) if rewards else float("nan"),
    }


# The training-inference mismatch each step measures (rl_core.correction), averaged over steps.
CORRECTION_METRICS = (
    "correction/log_ratio_mean",
    "correction/log_ratio_p01",
    "correction/log_ratio_p99",
    "correction/kl_k3",
    "correction/masked_tokens/cap_mask",
    "correction/capped_tokens/truncate",
    "correction/masked_tokens/token_band",
    "correction/masked_seqs/sequence_reject",
)


def _servers(database: Path, run_id: str) -> list[str]:
    import sqlite3

    with sqlite3.connect(database, timeout=5) as db:
        rows = db.execute(
            "SELECT url FROM gateway_inferenceserver WHERE run_id = ?", (run_id.replace("-", ""),)
        ).fetchall()
    return [row[0] for row in rows]


def _metric(rest, run_id: str, name: str) -> list[dict]:
    out, page = [], f"/runs/{run_id}/metrics/?name={name}&page_size=500"
    while page:
        body = rest.get(page).json()
        out += body["results"]
        page = body["next"]
    return out


def table(results: list[dict], steps: int) -> str:
    lines = [
        f"| backend | max_staleness | time to {steps} steps (s) | trajectories trained | trajectories/s | time per weight update (s) | inference utilisation | reward first 5 → last 5 |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['backend']} | {r['max_staleness']} | {r['wall_s']:.1f} | {r['trajectories_trained']} | {r['trajectories_per_s']:.1f} | "
            f"{r['weight_update_s']:.3f} | {r['inference_utilisation']:.0%} | {r['reward_first5']:.2f} → {r['reward_last5']:.2f} |"
        )
    lines += [
        "",
        "Training-inference mismatch, mean over steps (`correction/` metrics; w = exp(p - b)):",
        "",
        "| backend | serving dtype | log w mean | log w p01 | log w p99 | KL k3 | cap_mask masks | truncate caps | token_band masks | sequence_reject masks (seqs) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = [r["mismatch"].get(name, float("nan")) for name in CORRECTION_METRICS]
        lines.append(
            f"| {r['backend']} | {r['serving_dtype']} | {m[0]:.2e} | {m[1]:.2e} | {m[2]:.2e} | {m[3]:.2e} | "
            f"{m[4]:.2%} | {m[5]:.2%} | {m[6]:.2%} | {m[7]:.2%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
