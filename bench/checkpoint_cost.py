"""What a checkpoint costs beside a training step, full fine-tuning vs LoRA (adapter only).

A run checkpoints every ``save_every`` steps; after a crash it resumes from the last one and
trains again what was trained after it (the trajectories are kept, the compute is not). So
``save_every`` trades the checkpoint's cost, paid every ``save_every`` steps, against the
steps trained twice after a crash, ``(save_every - 1) / 2`` on average. This measures both
sides on one machine: a training step of ``--tokens`` tokens, ``save_checkpoint`` (float32
weights or the adapter, optimizer state, RNG) and ``load_checkpoint``, and prints the
overhead of each ``save_every`` (checkpoint time / (save_every x step time)). With
``async_checkpoints`` (the default) a step waits only for ``checkpoint_snapshot``, the
in-memory copy, while the disk write goes on beside the next steps: "copy s" is that wait,
and the async overhead is computed from it.

Models as in ``bench/train_step.py`` (random weights, the tiny tokenizer): ``small`` by
default; ``qwen2-0.5b`` for a real size. The checkpoint is written to ``--dir`` (default a
temporary directory: on the same disk as a run's ``DATA_DIR`` for a fair figure).

    python bench/checkpoint_cost.py
    python bench/checkpoint_cost.py --model qwen2-0.5b --tokens 1024 --lora-rank 16
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_step as ts  # noqa: E402  (bench/train_step.py: models and batches)


def measure(model_dir: Path, lora_rank: int, args: argparse.Namespace, out: Path) -> dict:
    import torch

    from rl_core.config import RunConfig
    from rl_core.trainer import PPOTrainer

    torch.set_num_threads(args.threads)
    lengths = ts.long_tailed_lengths(args.tokens, 64, 0.8, 512, seed=0)
    cfg = {
        "base_model": str(model_dir),
        "mode": "online",
        "batch_size": len(lengths),
        "micro_batch_tokens": args.tokens,
        "learning_rate": 1e-5,
        "lora_rank": lora_rank,
    }
    trainer = PPOTrainer(RunConfig.from_dict(cfg), device="cpu")
    batch = ts.make_batch(lengths, trainer.model.config.vocab_size, seed=1)
    trainer.train_step(batch)  # warm-up; creates the optimizer state a checkpoint holds
    steps, saves, loads, copies = [], [], [], []
    for i in range(args.repeats):
        started = time.perf_counter()
        trainer.train_step(batch)
        steps.append(time.perf_counter() - started)
        path = out / f"{'lora' if lora_rank else 'full'}-{i}"
        started = time.perf_counter()
        trainer.save_checkpoint(path)
        saves.append(time.perf_counter() - started)
        started = time.perf_counter()
        trainer.load_checkpoint(path)
        loads.append(time.perf_counter() - started)
        started = time.perf_counter()
        write = trainer.checkpoint_snapshot()
        copies.append(time.perf_counter() - started)
        assert write is not None
        write(str(out / f"async-{i}"))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {
        "case": f"LoRA r={lora_rank}" if lora_rank else "full",
        "step_s": statistics.median(steps),
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
        "copy_s": statistics.median(copies),
        "bytes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(ts.MODELS))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="steep-ckpt-", dir=args.dir))
    try:
        model_dir = ts.build_model(args.model, root)
        rows = [measure(model_dir, rank, args, root) for rank in (0, args.lora_rank)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"model {args.model}, {args.tokens} tokens per step, {args.threads} threads,"
        f" {platform.processor() or platform.machine()}, median of {args.repeats}"
    )
    print(
        "| case | step s | save s | copy s | load s | checkpoint MB"
        " | overhead at save_every 1 / 10 / 20 / 50, in step | asynchronous |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:

        def overhead(seconds: float, r: dict = r) -> str:
            return " / ".join(f"{100 * seconds / (n * r['step_s']):.1f}%" for n in (1, 10, 20, 50))

        print(
            f"| {r['case']} | {r['step_s']:.2f} | {r['save_s']:.2f} | {r['copy_s']:.3f}"
            f" | {r['load_s']:.2f} | {r['bytes'] / 1e6:.1f} | {overhead(r['save_s'])}"
            f" | {overhead(r['copy_s'])} |"
        )


if __name__ == "__main__":
    main()
