"""Shared inference pool vs dedicated engines: N LoRA runs on one engine, or one engine each.

    nice -n 19 .venv/bin/python bench/pool.py [--backend torch|vllm] [--model tiny|tiny32|PATH]
        [--runs 1,2,4] [--clients 4] [--duration 20] [--warmup 3] [--cores 0,1] [--threads 1]
        [--max-new-tokens 16] [--flood 16] [--flood-batch 16] [--profile]
        [--out .steep/bench/pool.json]

A "run" here is what a LoRA run puts on its inference servers: one adapter (rank 8, random
B, saved in peft's format: what a training step publishes) and ``--clients`` agents, each
asking for one ``--max-new-tokens`` sampled trajectory after another under that adapter
(SGLang's ``/generate`` with ``lora_path``; vLLM's ``/inference/v1/generate`` with the
adapter's name as ``model``). For each N in ``--runs``:

``shared``     one engine with every run's adapter loaded (``--max-loras-per-batch`` N, vLLM's
               ``--max-loras`` N): the pool; its requests of all runs share one running batch.
``dedicated``  N engines, one per run, each serving only its run's adapter: what each run
               starting its own servers gives today.

``--backend`` picks the engine: Steep's torch engine (default) or vLLM's CPU build (from
``.venv-vllm``, ``./steep install --vllm``; float32, a 1 GiB KV cache per server, each
server's OpenMP threads left unbound so N of them share ``--cores`` as the torch engines do).
vLLM's CPU attention needs a head size of 32 or more: ``--model tiny32`` is the tiny model
at that head size.

Both get the same cores: the bench pins itself (and so every engine it starts) to
``--cores``; every engine runs ``--threads`` torch threads (default 1: on a shared, busy
machine two threads per engine spin against each other and an engine crawls), so the N
dedicated engines have N times the shared engine's threads, unless ``--shared-threads``
gives the shared one more (e.g. the number of cores). Reported per cell: aggregate trajectories/s over
``--duration`` s after ``--warmup`` s, fairness = min/max of the runs' trajectories, the
engines' summed resident memory (RSS, MiB), and the p50 latency of a trajectory.

``--flood F`` adds the fair-share check of issue 17: two runs on one shared engine, run A
with one client and run B with F; run A's p50 latency next to its p50 alone on the engine.
That engine's batch is ``--flood-batch`` rows (``--max-running-requests``): the fair share
gives each of the two runs half of it (``rl_core/inference/torch_engine/fair.py``), so it
only holds B back when half the batch is fewer rows than B's F clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_core.inference.launch import TorchEngineServer  # noqa: E402
from rl_core.inference.vllm import VLLMServer, client_for  # noqa: E402

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world"


def make_adapters(model: Path, out: Path, n: int) -> list[Path]:
    """``n`` peft adapters of rank 8 with random B (each run's policy differs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for index in range(n):
        path = out / f"run{index}"
        if not (path / "adapter_config.json").exists():
            torch.manual_seed(index)
            base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
            peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
            with torch.no_grad():
                for name, param in peft.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0.0, 0.05)
            peft.save_pretrained(str(path), save_embedding_layers=False)
        paths.append(path)
    return paths


def preset(name: str, vocab: int, work: Path) -> Path:
    """A random-weight model of ``bench/train_step.py``'s preset ``name`` (no hub here)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train_step

    if name not in train_step.MODELS:
        raise SystemExit(
            f"--model {name!r}: not tiny, a preset ({sorted(train_step.MODELS)}) or a dir"
        )
    if vocab:
        train_step.MODELS[name] = {**train_step.MODELS[name], "vocab_size": vocab}
    return train_step.build_model(name, work)


def rss_mib(pid: int) -> float:
    """Resident memory of the engine process ``pid`` and its children (vLLM runs its model in
    a child, EngineCore), MiB (Linux ``/proc``)."""
    total = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1]) / 1024
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            total += rss_mib(int(child))
    return total


def gpu_mib(pids: list[int]) -> float:
    """GPU memory the processes ``pids`` hold (``nvidia-smi``), MiB."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    used = {int(p): float(m) for p, m in (line.split(",") for line in out.splitlines() if line)}
    return sum(used.get(pid, 0.0) for pid in pids)


def engine(
    args, model: Path, n_adapters: int, logs: Path, name: str, batch: int = 64, threads: int = 0
):
    threads = threads or args.threads
    if args.backend == "vllm":
        return VLLMServer(
            model,
            host="127.0.0.1",
            dtype=args.dtype,
            max_model_len=1024,
            max_num_seqs=batch,
            kv_cache_space_gb=1,
            lora_rank=8,
            max_loras_per_batch=max(1, n_adapters),
            max_loaded_loras=max(1, n_adapters),
            log_path=logs / f"{name}.log",
            env={"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        )
    return TorchEngineServer(
        model,
        host="127.0.0.1",
        num_threads=threads,
        dtype=args.dtype,
        device=args.device,
        lora_rank=8,
        max_loras_per_batch=max(1, n_adapters),
        max_running_requests=batch,
        log_path=logs / f"{name}.log",
        extra_args=["--no-cudnn-attention"] if args.no_cudnn_attention else [],
    )


async def drive(
    targets: list[tuple[str, str, int]],
    duration: float,
    warmup: float,
    max_new: int,
    backend: str = "torch",
) -> dict[str, list[float]]:
    """``targets``: (run name, server url, clients). Each client loops one trajectory after
    another under the run's adapter; per run, the latencies of those that finished in the window."""
    clients = {url: client_for(backend, url) for _, url, _ in targets}
    latencies: dict[str, list[float]] = {run: [] for run, _, _ in targets}
    start = time.perf_counter()
    window = (start + warmup, start + warmup + duration)

    async def agent(run: str, url: str, seed: int) -> None:
        i = 0
        while time.perf_counter() < window[1]:
            began = time.perf_counter()
            params = {"max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": seed + i}
            await clients[url].generate(PROMPT, params, lora_path=run)
            ended = time.perf_counter()
            if window[0] <= ended <= window[1]:
                latencies[run].append(ended - began)
            i += 1

    await asyncio.gather(
        *(
            agent(run, url, 1000 * k + c)
            for k, (run, url, count) in enumerate(targets)
            for c in range(count)
        )
    )
    for client in clients.values():
        await client.aclose()
    return latencies


async def load(url: str, adapters: dict[str, Path], backend: str = "torch") -> None:
    """Load each adapter and answer one request under it, so that no engine's first-use
    work (vLLM compiles its LoRA kernels on the first batch that uses one) lands in a window."""
    async with client_for(backend, url) as client:
        for name, path in adapters.items():
            await client.load_lora_adapter(name, str(path))
            await client.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True}, lora_path=name)


def cell(kind: str, n: int, args, model: Path, adapters: list[Path], logs: Path) -> dict:
    runs = {f"run{i}": adapters[i] for i in range(n)}
    if kind == "shared":
        threads = args.shared_threads or args.threads
        servers = [engine(args, model, n, logs, f"shared-{n}", args.batch, threads)]
        placement = {run: 0 for run in runs}
    else:
        servers = [engine(args, model, 1, logs, f"ded-{n}-{i}", args.batch) for i in range(n)]
        placement = {run: i for i, run in enumerate(runs)}
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_healthy(timeout=900)
        for run, index in placement.items():
            asyncio.run(load(servers[index].url, {run: runs[run]}, args.backend))
        targets = [(run, servers[index].url, args.clients) for run, index in placement.items()]
        latencies = asyncio.run(
            drive(targets, args.duration, args.warmup, args.max_new_tokens, args.backend)
        )
        memory = sum(rss_mib(server.process.pid) for server in servers)
        gpu = gpu_mib([server.process.pid for server in servers]) if args.device != "cpu" else 0
    finally:
        for server in servers:
            server.stop()
    done = {run: len(values) for run, values in latencies.items()}
    every = [x for values in latencies.values() for x in values]
    return {
        "kind": kind,
        "runs": n,
        "trajectories_per_s": sum(done.values()) / args.duration,
        "fairness": min(done.values()) / max(done.values()) if max(done.values()) else 0.0,
        "per_run": done,
        "rss_mib": memory,
        "gpu_mib": gpu,
        "p50_s": statistics.median(every) if every else float("nan"),
    }


def profiler(pid: int, args) -> subprocess.Popen:
    """py-spy the engine ``pid`` through the flooded window (raw collapsed stacks; summarise
    them with ``bench/pyspy_summary.py``). The profile slows the engine: not a measurement."""
    pyspy = ROOT / ".venv" / "bin" / "py-spy"
    out = Path(args.out).with_name("pool-flood-profile.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"profiling the flooded engine -> {out}", flush=True)
    return subprocess.Popen(
        [str(pyspy if pyspy.exists() else "py-spy"), "record", "--pid", str(pid), "--duration",
         str(round(args.warmup + args.duration)), "--rate", "250", "--format", "raw",
         "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def flood(args, model: Path, adapters: list[Path], logs: Path) -> dict:
    """Run A (1 client) alone, then beside run B (``--flood`` clients), on one shared engine."""
    server = engine(args, model, 2, logs, "flood", batch=args.flood_batch)
    server.start()
    try:
        server.wait_healthy(timeout=900)
        asyncio.run(load(server.url, {"run0": adapters[0], "run1": adapters[1]}, args.backend))
        alone = asyncio.run(
            drive(
                [("run0", server.url, 1)],
                args.duration,
                args.warmup,
                args.max_new_tokens,
                args.backend,
            )
        )
        spy = profiler(server.process.pid, args) if args.profile else None
        both = asyncio.run(
            drive(
                [("run0", server.url, 1), ("run1", server.url, args.flood)],
                args.duration,
                args.warmup,
                args.max_new_tokens,
                args.backend,
            )
        )
        if spy is not None:
            spy.wait(60)
    finally:
        server.stop()
    solo, beside = statistics.median(alone["run0"]), statistics.median(both["run0"])
    return {
        "flood_clients": args.flood,
        "flood_batch": args.flood_batch,
        "run_a_p50_alone_s": solo,
        "run_a_p50_flooded_s": beside,
        "ratio": beside / solo,
        "run_b_trajectories": len(both["run1"]),
        "run_a_trajectories": len(both["run0"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", default="torch", choices=("torch", "vllm"), help="the engines to compare"
    )
    parser.add_argument(
        "--model",
        default="tiny",
        help="tiny (rl_core.tiny), tiny32 (the same at head size 32, for vLLM), a preset of bench/train_step.py (random weights, e.g. "
        "qwen2-0.5b), or a model dir",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="a preset's vocabulary size (0: the preset's; the tiny tokenizer's 260 keeps "
        "the engine's per-step CPU sampling out of a GPU measurement)",
    )
    parser.add_argument("--device", default="cpu", help="the engines' torch device (cuda)")
    parser.add_argument("--dtype", default="float32", help="the engines' --dtype (bfloat16)")
    parser.add_argument(
        "--batch", type=int, default=64, help="--max-running-requests of the N-run engines"
    )
    parser.add_argument(
        "--no-cudnn-attention", action="store_true", help="the engines' flag of that name (CUDA)"
    )
    parser.add_argument("--runs", default="1,2,4")
    parser.add_argument("--clients", type=int, default=4, help="agents per run")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--cores", default="0,1", help="CPU cores every engine shares (0-15)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument(
        "--shared-threads",
        type=int,
        default=0,
        help="threads of the shared engine (0: --threads); the cores' count gives the one "
        "engine what the N dedicated ones have together",
    )
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--flood", type=int, default=16, help="0 skips the fair-share check")
    parser.add_argument(
        "--flood-batch", type=int, default=16, help="--max-running-requests of the flood engine"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the flood engine (its ratio is then not a result)",
    )
    parser.add_argument("--out", default=str(ROOT / ".steep" / "bench" / "pool.json"))
    args = parser.parse_args(argv)
    args.cores = [
        c
        for part in args.cores.split(",")
        for c in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)
    ]
    os.sched_setaffinity(0, args.cores)  # every engine started from here inherits it
    # A SIGTERM unwinds through the cells' ``finally``, which stop the engines they started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="steep-bench-pool-"))
    if args.model == "tiny":
        from rl_core.tiny import build_tiny_model

        model = build_tiny_model(work / "tiny")
    elif args.model == "tiny32":
        from rl_core.tiny import build_tiny_model

        model = build_tiny_model(work / "tiny32", hidden=64, heads=2, kv_heads=1)
    elif not Path(args.model).is_dir():
        model = preset(args.model, args.vocab, work)
    else:
        model = Path(args.model)
    counts = [int(n) for n in args.runs.split(",") if n]  # "": the flood check only
    adapters = make_adapters(model, work / "adapters", max(counts + [2]))
    results = []
    print(
        f"{'N':>2} {'engines':<10} {'traj/s':>8} {'fairness':>8} {'RSS MiB':>8} "
        f"{'GPU MiB':>8} {'p50 s':>7}"
    )
    for n in counts:
        for kind in ("shared", "dedicated"):
            row = cell(kind, n, args, model, adapters, work)
            results.append(row)
            print(
                f"{n:>2} {kind:<10} {row['trajectories_per_s']:>8.2f} {row['fairness']:>8.2f} "
                f"{row['rss_mib']:>8.0f} {row['gpu_mib']:>8.0f} {row['p50_s']:>7.3f}",
                flush=True,
            )
    report: dict = {"cells": results, "args": {k: v for k, v in vars(args).items()}}
    if args.flood:
        report["flood"] = flood(args, model, adapters, work)
        f = report["flood"]
        print(
            f"fair share: run A p50 {f['run_a_p50_alone_s']:.3f} s alone, "
            f"{f['run_a_p50_flooded_s']:.3f} s beside {args.flood} clients of run B "
            f"({f['ratio']:.2f}x; batch {args.flood_batch}; B finished {f['run_b_trajectories']})"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
