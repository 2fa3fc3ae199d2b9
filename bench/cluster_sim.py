"""Steep's loop at cluster scale, by simulation: async vs sync where GPUs set the pace (issue 19).

Every run is Steep's own dataset run (``rl_core.rollout.LocalRun``: rollout driver, staleness
controller, queue, ``TrainingLoop``, weight sync) or its online admission with a population
of agents (``rl_core.sim.agents``), against ``SimServer`` stand-ins of SGLang on H100s and a
``SimTrainer`` (``rl_core/sim/``), on a simulated clock: the numbers are simulated seconds,
reproducible for a seed on any machine, and a sweep takes minutes of wall time.

    python bench/cluster_sim.py staleness [--servers 16]   # max_staleness 0,1,2,4,8; both length distributions
    python bench/cluster_sim.py servers                    # N = 4, 16, 64 (sync vs async)
    python bench/cluster_sim.py sync                       # disk vs distributed vs LoRA weight sync (7B)
    python bench/cluster_sim.py areal                      # AReaL's setting: ratio and the analytic bound
    python bench/cluster_sim.py lora                       # LoRA: answers moved onto new adapters or not
    python bench/cluster_sim.py agents                     # 1,000 online agents: time spent backing off
    python bench/cluster_sim.py all [--json out.json]

Trainer GPUs are a quarter of the inference servers (``--trainer-ratio``) and the batch is
16 trajectories per server, so every N has the same per-server load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.inference.adapters import move_lag  # noqa: E402
from rl_core.sim.agents import AgentSimConfig, simulate_agents  # noqa: E402
from rl_core.sim.cluster import ClusterSimConfig, ClusterSimResult, simulate  # noqa: E402


def _config(args: argparse.Namespace, **overrides: Any) -> ClusterSimConfig:
    servers = overrides.pop("servers", args.servers)
    base = dict(
        servers=servers,
        trainer_gpus=max(1, round(servers * args.trainer_ratio)),
        batch_size=16 * servers,
        group_size=args.group_size,
        steps=args.steps,
        model=args.model,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    if args.mfu is not None:
        base["mfu"] = args.mfu
    base["max_queued_batches"] = args.max_queued_batches
    base.update(overrides)
    return ClusterSimConfig(**base)


def _run(cfg: ClusterSimConfig, results: list[dict]) -> ClusterSimResult:
    started = time.perf_counter()
    r = simulate(cfg)
    row = dataclasses.asdict(r)
    row.pop("step_times")
    row["wall_s"] = time.perf_counter() - started
    results.append(row)
    return r


def _stale_hist(r: ClusterSimResult) -> str:
    total = sum(r.staleness.values()) or 1
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in r.staleness.items())


def _slots(r: ClusterSimResult) -> str:
    s = r.slots
    return "/".join(
        f"{s.get(k, 0.0):.0f}" for k in ("decoding", "group_wait", "queued", "training")
    )


HEADER = (
    "| N | M | lengths | sync | max_staleness | traj/s | trained tok/s | vs sync (traj) | vs sync (tokens) | % of bound (tokens) "
    "| % of per-token bound | idle infer | mean batch | idle train | dropped "
    "| slots: decoding/group wait/queued/training | staleness of trained tokens | sim s | wall s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(r: ClusterSimResult, sync: ClusterSimResult | None, wall: float) -> str:
    c = r.config
    ratio = f"{r.trajectories_per_s / sync.trajectories_per_s:.2f}x" if sync else "-"
    tokens = f"{r.trained_tokens_per_s / sync.trained_tokens_per_s:.2f}x" if sync else "-"
    assert r.staleness_ok, f"staleness bound violated: {r.staleness}"
    return (
        f"| {c['servers']} | {c['trainer_gpus']} | {c['lengths']} | {c['weight_sync']} "
        f"| {c['max_staleness']} | {r.trajectories_per_s:.2f} | {r.trained_tokens_per_s:,.0f} "
        f"| {ratio} | {tokens} | {100 * r.trained_tokens_per_s / r.ideal_tokens_per_s:.0f}% "
        f"| {100 * r.trained_tokens_per_s / r.fresh_tokens_per_s:.0f}% "
        f"| {100 * r.inference_idle:.0f}% | {r.mean_batch:.0f} | {100 * r.trainer_idle:.0f}% | {r.dropped} "
        f"| {_slots(r)} | {_stale_hist(r)} | {r.sim_seconds:,.0f} | {wall:.0f} |"
    )


def _sweep(args: argparse.Namespace, configs: list[ClusterSimConfig], results: list[dict]) -> None:
    print(HEADER, flush=True)
    sync: ClusterSimResult | None = None
    for cfg in configs:
        started = time.perf_counter()
        r = _run(cfg, results)
        if cfg.max_staleness == 0:
            sync = r
        print(_row(r, sync, time.perf_counter() - started), flush=True)


def staleness(args: argparse.Namespace, results: list[dict]) -> None:
    for lengths in ("longtail", "uniform"):
        _sweep(
            args,
            [_config(args, lengths=lengths, max_staleness=s) for s in (0, 1, 2, 4, 8)],
            results,
        )


def servers(args: argparse.Namespace, results: list[dict]) -> None:
    _sweep(
        args,
        [_config(args, servers=n, max_staleness=s) for n in (4, 16, 64) for s in (0, 4)],
        results,
    )


def sync(args: argparse.Namespace, results: list[dict]) -> None:
    _sweep(
        args,
        [
            _config(args, model="7b", weight_sync=w, max_staleness=s)
            for w in ("distributed", "disk", "lora", "lora-keep")
            for s in (0, 4)
        ],
        results,
    )
    for r in results[-8:]:
        print(
            f"{r['config']['weight_sync']:>11} max_staleness={r['config']['max_staleness']}: "
            f"one weight sync {r['sync_seconds']:.2f} s (trainer side), "
            f"servers paused {r['inference_paused_s'] / r['config']['servers']:.1f} s each over the run"
        )


def areal(args: argparse.Namespace, results: list[dict]) -> None:
    # AReaL's headline (Fu et al. 2025): 1.5B, long-tailed reasoning lengths, max_staleness 4,
    # generation and training on separate GPUs (3:1 here as in its default allocation).
    for group in (args.group_size, 1):  # a group waits for its longest member: 1 shows the cost
        configs = [
            _config(
                args,
                servers=24,
                trainer_gpus=8,
                group_size=group,
                max_staleness=s,
                steps=args.areal_steps,
            )
            for s in (0, 4, 8)
        ]
        print(f"\ngroup_size {group}\n")
        _sweep(args, configs, results)


def lora(args: argparse.Namespace, results: list[dict]) -> None:
    # AReaL's setting with the three syncs: a broadcast (pause in place), LoRA adapters with
    # the answers in flight moved onto each new one (AdapterSwitch, lag move_lag(η)), and
    # LoRA adapters each answer keeps from start to end.
    areal = dict(servers=24, trainer_gpus=8, steps=args.areal_steps)
    by_key: dict[tuple[int, int], ClusterSimResult] = {}
    for eta in (4, 8):
        print(f"\nmax_staleness {eta}\n")
        print(HEADER, flush=True)
        for w in ("distributed", "lora", "lora-keep"):
            started = time.perf_counter()
            r = _run(_config(args, weight_sync=w, max_staleness=eta, **areal), results)
            if w == "lora":
                by_key[(eta, move_lag(eta))] = r
            print(_row(r, None, time.perf_counter() - started), flush=True)
    print(
        "\n| max_staleness | moved when its adapter is k versions old | trained tok/s | dropped |"
    )
    print("|---|---|---|---|")
    for eta, lags in ((4, (1, 2, 3)), (8, (1, 2, 4))):
        for lag in lags:
            r = by_key.get((eta, lag)) or _run(
                _config(args, weight_sync="lora", max_staleness=eta, lora_move_lag=lag, **areal),
                results,
            )
            default = " (move_lag)" if lag == move_lag(eta) else ""
            print(
                f"| {eta} | {lag}{default} | {r.trained_tokens_per_s:,.0f} | {r.dropped} |",
                flush=True,
            )


def agents(args: argparse.Namespace, results: list[dict]) -> None:
    print(
        "| agents | batch_size | max_staleness | sessions/s | trained tok/s | backing off | 429s "
        "| max staleness seen | dropped | idle infer | idle train | sim s | wall s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    # 320 = 1.25 x agents / max_staleness: the budget holds every agent (docs/benchmarks/async.md).
    for batch in (8, 64, 256, 320):
        cfg = _config(
            args,
            batch_size=batch,
            max_staleness=4,
            steps=args.agent_steps,
            max_tokens=4096,
            min_tokens=256,
        )
        started = time.perf_counter()
        r = simulate_agents(cfg, AgentSimConfig(agents=args.agents))
        wall = time.perf_counter() - started
        assert r.max_staleness_seen <= 4, r.staleness
        results.append({**dataclasses.asdict(r), "wall_s": wall})
        print(
            f"| {args.agents} | {batch} | 4 | {r.trajectories_per_s:.2f} | {r.trained_tokens_per_s:,.0f} "
            f"| {100 * r.backoff_fraction:.1f}% | {r.refusals} | {r.max_staleness_seen} | {r.dropped} "
            f"| {100 * r.inference_idle:.0f}% | {100 * r.trainer_idle:.0f}% | {r.sim_seconds:,.0f} | {wall:.0f} |",
            flush=True,
        )


SECTIONS = {
    "staleness": staleness,
    "servers": servers,
    "sync": sync,
    "areal": areal,
    "lora": lora,
    "agents": agents,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("section", choices=[*SECTIONS, "all"])
    parser.add_argument("--servers", type=int, default=16, help="inference servers (N)")
    parser.add_argument("--trainer-ratio", type=float, default=0.25, help="trainer GPUs per server")
    parser.add_argument("--steps", type=int, default=20)
    # The longest answers take ~100 s, ~18 steps at AReaL's setting: 20 steps would measure
    # the start-up, when only short answers have finished (trained tokens/s 40% too high).
    parser.add_argument("--areal-steps", type=int, default=60)
    parser.add_argument("--group-size", type=int, default=8, help="answers per prompt (GRPO group)")
    parser.add_argument("--model", default="1.5b", choices=["1.5b", "7b", "1.5b-torch"])
    parser.add_argument(
        "--mfu", type=float, default=None, help="the trainer's fraction of peak (default: measured)"
    )
    parser.add_argument(
        "--max-queued-batches", type=int, default=0, help="RunConfig's setting (0: no cap)"
    )
    parser.add_argument("--min-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--agent-steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write every result here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results: list[dict] = []
    for name in SECTIONS if args.section == "all" else [args.section]:
        print(f"\n## {name}\n", flush=True)
        SECTIONS[name](args, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
