"""Saving from FSDP2 trainer workers: weights for servers and checkpoints written a tensor at a
time by every rank (``rl_core.streamed_weights``, DCP for the optimizer) against gathering the
full model and optimizer state onto rank 0 and writing them there (before issue 35).

``--workers`` gloo processes (one torch thread each) build a ``PPOTrainer`` on the model and take
one small step (so AdamW's moments exist), then, each measured on every rank (peak resident
memory growth over the call, ``rl_core.memory.PeakMemory``, after ``malloc_trim`` returned what
earlier calls freed to the OS; and wall time):

- ``save_weights``: what servers load (the base model's dtype);
- ``save_checkpoint``: float32 weights + optimizer (``optimizer/`` DCP files) + trainer state;
- ``load_checkpoint``: that checkpoint read back (each rank its rows and shards);
- ``gathered checkpoint``: the path before (its figures are of this bench's own code): ``full_model_state`` and ``full_optimizer_state``
  onto rank 0's CPU, written there (``save_pretrained`` + ``torch.save``).

    python bench/saving.py                                  # SmolLM2-135M-Instruct, 2 workers
    python bench/saving.py --file-mb 64                     # files of at most 64 MiB
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9


def _worker(rank: int, world: int, store: str, out: str, path: str, file_mb: int) -> None:
    import torch
    import torch.distributed as dist

    from rl_core import streamed_weights
    from rl_core.config import RunConfig
    from rl_core.distributed import full_model_state, full_optimizer_state
    from rl_core.memory import PeakMemory
    from rl_core.trainer import PPOTrainer
    from rl_core.types import Trajectory

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        if file_mb:
            streamed_weights.FILE_BYTES = file_mb << 20
        cfg = {"base_model": path, "mode": "online", "train_workers": world}
        trainer = PPOTrainer(RunConfig.from_dict(cfg), device="cpu")
        mask = [0, 0] + [1] * 14
        versions = [0 if m else -1 for m in mask]
        batch = [
            Trajectory(list(range(s, s + 16)), mask, [-10.0] * 16, versions, [r])
            for s, r in ((100, 0.0), (300, 1.0))
        ]
        trainer.train_step(batch)
        cpu = torch.device("cpu")

        def gathered(target: str) -> None:
            state = full_model_state(trainer.model)
            optimizer = full_optimizer_state(trainer.model, trainer.optimizer)
            if rank == 0:
                trainer.model.save_pretrained(target, state_dict=state)
                torch.save(optimizer, f"{target}/optimizer.pt")
            dist.barrier()

        calls = [
            ("save_weights", lambda: trainer.save_weights(f"{out}/weights")),
            ("save_checkpoint", lambda: trainer.save_checkpoint(f"{out}/ckpt")),
            ("load_checkpoint", lambda: trainer.load_checkpoint(f"{out}/ckpt")),
            ("gathered checkpoint", lambda: gathered(f"{out}/gathered")),
        ]
        rows = []
        trim = ctypes.CDLL("libc.so.6").malloc_trim
        for name, call in calls:
            gc.collect()
            trim(0)  # what earlier calls freed goes back to the OS: this call's growth is its own
            dist.barrier()
            memory = PeakMemory(cpu).start()
            started = time.perf_counter()
            call()
            seconds = time.perf_counter() - started
            rows.append(
                {
                    "call": name,
                    "rank": rank,
                    "s": seconds,
                    "peak_gb": memory.peak_gb() - memory.start_gb,
                }
            )
        params = sum(p.numel() for p in trainer.model.parameters())
        Path(f"{out}/rows_{rank}.json").write_text(json.dumps({"rows": rows, "params": params}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--file-mb", type=int, default=0, help="weight files' bound (0: 1 GiB)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from tests.smollm2 import prepare_smollm2

    path = prepare_smollm2()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _worker,
            args=(args.workers, f"{tmp}/store", tmp, str(path), args.file_mb),
            nprocs=args.workers,
        )
        results = [
            json.loads(Path(f"{tmp}/rows_{r}.json").read_text()) for r in range(args.workers)
        ]
    params = results[0]["params"]
    print(
        f"# SmolLM2-135M-Instruct ({params / 1e6:.0f}M parameters: {4 * params / GB:.2f} GB float32, "
        f"AdamW {8 * params / GB:.2f} GB), {args.workers} gloo workers, "
        f"files of {args.file_mb or 1024} MiB, {platform.processor() or platform.machine()}"
    )
    print(
        "| call | "
        + " | ".join(f"rank {r} s | rank {r} peak + GB" for r in range(args.workers))
        + " |"
    )
    print("|---|" + "---:|---:|" * args.workers)
    rows = [row for r in results for row in r["rows"]]
    for name in dict.fromkeys(row["call"] for row in rows):
        mine = sorted((row for row in rows if row["call"] == name), key=lambda row: row["rank"])
        cells = " | ".join(f"{row['s']:.2f} | {row['peak_gb']:.3f}" for row in mine)
        print(f"| {name} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
