"""Loading a model into FSDP2 trainer workers: sharded loading (``rl_core.sharded_load``, what
``train_workers > 1`` uses) vs the whole model on every rank, then sharded (before issue 35).

Each mode starts ``--workers`` gloo processes (``torch.multiprocessing``, one torch thread
each) that load the same model with the same config, as trainer ranks do. Per rank:

- ``load s``: wall time of the load (construction, sharding, filling the shards);
- ``peak +``: growth of the process's peak resident memory during the load (Linux ``VmHWM``
  reset just before it, ``rl_core.memory.PeakMemory``), after imports and the model classes
  were loaded by a meta-device warm-up, so it counts the weights and the temporaries;
- ``holds``: the bytes of this rank's float32 shards when the load returns.

``host peak +`` sums the ranks' peaks (all ranks of one node): the host memory a node needs.

    python bench/loading.py                            # SmolLM2-135M-Instruct, 2 workers
    python bench/loading.py --model qwen2-1.5b --workers 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9


def _model(name: str) -> Path:
    if name == "smollm2":
        from tests.smollm2 import prepare_smollm2

        return prepare_smollm2()
    from rl_core.memory_plan import qwen2_config

    data = Path(os.environ.get("DATA_DIR", ".steep/data")).resolve()
    out = data / "models" / f"bench-{name}-bf16"
    if not (out / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(qwen2_config(name.removeprefix("qwen2-")))
        model.to(torch.bfloat16).save_pretrained(out)
    return out


def _worker(rank: int, world: int, store: str, out: str, path: str, mode: str) -> None:
    import peft  # noqa: F401  (imports before the meter)
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_core import lora
    from rl_core.config import RunConfig
    from rl_core.distributed import shard_model
    from rl_core.memory import PeakMemory
    from rl_core.sharded_load import load_sharded

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        cfg = RunConfig.from_dict({"base_model": path, "mode": "online", "train_workers": world})
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        cpu = torch.device("cpu")
        dist.barrier()
        memory = PeakMemory(cpu).start()
        started = time.perf_counter()
        if mode == "sharded":
            model = load_sharded(path, cfg, torch.float32, cpu)
        else:
            model = lora.load_policy(path, cfg, torch.float32, cpu)
            shard_model(model)
        seconds = time.perf_counter() - started
        peak = memory.peak_gb() - memory.start_gb
        holds = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / GB
        total = sum(p.numel() for p in model.parameters())
        dist.barrier()
        result = {"rank": rank, "load_s": seconds, "peak_gb": peak, "holds_gb": holds}
        Path(f"{out}/{mode}_{rank}.json").write_text(json.dumps({**result, "params": total}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, or qwen2-<size> of rl_core.memory_plan.QWEN2 (random bf16 weights)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--modes", default="sharded,whole")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    path = _model(args.model)
    print(f"# {args.model} ({path}), {args.workers} gloo workers, {platform.processor() or ''}")
    print("| mode | rank | load s | peak + GB | holds GB |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(
                _worker,
                args=(args.workers, f"{tmp}/store", tmp, str(path), mode),
                nprocs=args.workers,
            )
            results = [
                json.loads(Path(f"{tmp}/{mode}_{r}.json").read_text()) for r in range(args.workers)
            ]
        for r in results:
            rows.append({"mode": mode, "model": args.model, **r})
            print(
                f"| {mode} | {r['rank']} | {r['load_s']:.2f} | {r['peak_gb']:.3f} | "
                f"{r['holds_gb']:.3f} |",
                flush=True,
            )
        host = sum(r["peak_gb"] for r in results)
        whole = results[0]["params"] * 4 / GB
        print(f"| {mode} | host peak + | | {host:.3f} | model {whole:.3f} (float32) |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
