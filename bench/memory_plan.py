"""Memory plans of Qwen2-shaped 1.5B-32B models (rl_core/memory_plan.py): per-rank bytes, one step's
peak, and the GPUs a run needs, found on fake tensors over a fake process group (no GPU).

    .venv/bin/python bench/memory_plan.py [--sizes 1.5b,7b,14b,32b] [--tokens 4096,16384,32768]
        [--worlds 8,16] [--peak-sizes 1.5b,7b] [--gpu-gb 80] [--margin 0.85] [--lora-rank 16]
        [--tables state,peak,sizing] [--json out.json]

Three tables, each plan one training micro-step of ``T`` tokens (sequences of 4,096) as the
trainer runs it on GPUs (float32 master weights sharded by FSDP2, bf16 compute, AdamW):

1. **State per rank** (``--worlds``): parameters + gradients + AdamW moments, against the
   arithmetic 16 bytes per parameter / N.
2. **A step's peak per rank** at 8 ranks: logprobs from the whole ``[T, V]`` logits or in
   chunks (``rl_core/head.py``), activation checkpointing off or on.
3. **Sizing**: the fewest GPUs (1, 2, 4, 8, 16, 32, 64) whose plan's peak fits in
   ``--margin`` x ``--gpu-gb`` (the rest is left to the CUDA allocator's reserve and
   fragmentation, kernels' workspaces and NCCL), chunked logprobs and checkpointing on, full
   weights and LoRA of rank ``--lora-rank``; what docs/deploy.md's sizing table shows.

Each plan runs in a process of its own (a plan makes its process's default process group).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1e9
WORLDS = (1, 2, 4, 8, 16, 32, 64)


def _plan(queue, size: str, settings: dict) -> None:
    from rl_core.memory_plan import plan_step, qwen2_config

    queue.put(plan_step(qwen2_config(size), **settings).__dict__)


def plan(size: str, **settings) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_plan, args=(queue, size, settings))
    process.start()
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except Exception:  # queue.Empty: is the planner still alive?
            if not process.is_alive():
                raise SystemExit(f"the plan of {size} {settings} failed") from None
    process.join(60)
    return result


def state_table(sizes: list[str], worlds: list[int]) -> tuple[str, list[dict]]:
    rows, lines = (
        [],
        [
            "| model | parameters | ranks | params GB | grads GB | AdamW GB | state GB | 16 B x P / N GB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ],
    )
    for size in sizes:
        for world in worlds:
            p = plan(size, world_size=world, tokens=4096, checkpointing=True)
            rows.append({"table": "state", "size": size, **p})
            arithmetic = 16 * p["parameters"] / world
            state = p["sharded_parameters"] + p["gradients"] + p["optimizer"]
            lines.append(
                f"| {size} | {p['parameters'] / 1e9:.2f} B | {world} | "
                f"{p['sharded_parameters'] / GB:.1f} | {p['gradients'] / GB:.1f} | "
                f"{p['optimizer'] / GB:.1f} | {state / GB:.1f} | {arithmetic / GB:.1f} |"
            )
    return "\n".join(lines), rows


def peak_table(sizes: list[str], tokens: list[int], world: int) -> tuple[str, list[dict]]:
    variants = [
        ("whole logits", {"chunked": False}),
        ("chunked", {"chunked": True}),
        ("whole logits + ckpt", {"chunked": False, "checkpointing": True}),
        ("chunked + ckpt", {"chunked": True, "checkpointing": True}),
    ]
    head = " | ".join(name for name, _ in variants)
    rows, lines = [], [f"| model | T | {head} |", "|---|---:|" + "---:|" * len(variants)]
    for size in sizes:
        for t in tokens:
            peaks = []
            for name, settings in variants:
                p = plan(size, world_size=world, tokens=t, **settings)
                rows.append({"table": "peak", "size": size, "variant": name, **p})
                peaks.append(f"{p['peak'] / GB:.1f}")
            lines.append(f"| {size} | {t:,} | " + " | ".join(peaks) + " |")
    return "\n".join(lines), rows


def fewest(size: str, tokens: int, budget: float, lora_rank: int) -> tuple[int | None, dict]:
    """The fewest GPUs whose plan fits ``budget`` bytes, starting from the state arithmetic."""
    from rl_core.memory_plan import QWEN2

    shape = QWEN2[size]
    h, i, layers, vocab = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_hidden_layers"],
        shape["vocab_size"],
    )
    approx = layers * (4 * h * h + 3 * h * i) + vocab * h * (
        1 if shape["tie_word_embeddings"] else 2
    )
    bytes_per_param = 4 if lora_rank else 16  # frozen float32 base; or the whole state
    last: dict = {}
    for world in WORLDS:
        if bytes_per_param * approx / world > budget:
            continue
        last = plan(
            size,
            world_size=world,
            tokens=tokens,
            checkpointing=True,
            chunked=True,
            lora_rank=lora_rank,
        )
        if last["peak"] <= budget:
            return world, last
    return None, last


def sizing_table(
    sizes: list[str], tokens: list[int], gpu_gb: float, margin: float, lora_rank: int
) -> tuple[str, list[dict]]:
    budget = gpu_gb * GB * margin
    head = " | ".join(f"T = {t:,}" for t in tokens)
    rows, lines = [], [f"| model | weights | {head} |", "|---|---|" + "---|" * len(tokens)]
    for size in sizes:
        for label, rank in (("full", 0), (f"LoRA r{lora_rank}", lora_rank)):
            cells = []
            for t in tokens:
                world, p = fewest(size, t, budget, rank)
                rows.append({"table": "sizing", "size": size, "weights": label, "gpus": world, **p})
                cells.append(f"{world} ({p['peak'] / GB:.0f} GB)" if world else f"> {WORLDS[-1]}")
            lines.append(f"| {size} | {label} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)  # a row at a time: the whole table takes a while
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1.5b,7b,14b,32b")
    parser.add_argument("--peak-sizes", default="1.5b,7b", help="sizes of the peak table")
    parser.add_argument("--tokens", default="4096,16384,32768", help="micro-batch sizes T")
    parser.add_argument("--worlds", default="8,16", help="ranks of the state table")
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="one GPU's memory, GB")
    parser.add_argument("--margin", type=float, default=0.85, help="share of it a plan may use")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--tables", default="state,peak,sizing")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    tables = args.tables.split(",")
    started, rows = time.perf_counter(), []
    if "state" in tables:
        text, made = state_table(sizes, worlds)
        print("State per rank (GB):\n\n" + text + "\n", flush=True)
        rows += made
    if "peak" in tables:
        text, made = peak_table(args.peak_sizes.split(","), tokens, 8)
        print("A step's peak per rank at 8 ranks, full weights (GB):\n\n" + text + "\n", flush=True)
        rows += made
    if "sizing" in tables:
        text, made = sizing_table(sizes, tokens, args.gpu_gb, args.margin, args.lora_rank)
        print(
            f"GPUs of {args.gpu_gb:.0f} GB per run (peak <= {args.margin:.0%}; chunked logprobs "
            f"and activation checkpointing on):\n\n" + text + "\n",
            flush=True,
        )
        rows += made
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
