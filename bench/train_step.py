"""One PPO step (``PPOTrainer.train_step``) on a long-tailed packed batch: tokens/s and peak memory.

Cases (each in a fresh process, so peak memory and allocator state are its own):

- attention: ``dense`` (the block-diagonal ``T x T`` additive mask, the trainer's path
  before issue #13, kept as ``rl_core.packing.block_causal_mask``) vs ``packed``
  (``rl_core.attention``: flash varlen / per-sequence SDPA, no ``T x T`` tensor);
- precision ``fp32`` vs ``bf16`` (autocast; float32 master weights and AdamW state);
- gradient checkpointing off / on;
- full fine-tuning vs LoRA (``--lora-rank``; reported as not available when this
  build's trainer trains every weight anyway);
- 1 vs 2 workers: two gloo processes (``torch.multiprocessing``), each a
  ``PPOTrainer`` with ``torch.distributed`` initialised, on the same batch (each
  trains its half of the sequences), each with ``--threads`` torch threads;
- logprobs from the model's whole ``[T, V]`` logits (``:logits``, the trainer's path before
  issue 35) vs from its hidden states in chunks (``rl_core.head``, the default).

Every case trains one micro-batch of ``T`` tokens (``micro_batch_tokens = T``,
one minibatch): sequence lengths are drawn from a lognormal (median ``--median``,
sigma ``--sigma``: many short sequences, a few long ones) until ``T`` is filled.
A step is: proximal logprobs (forward, no grad) + forward/backward + AdamW step.

Models are built from a config with random weights (no hub): ``small`` (a 4-layer
Llama, seconds per step on 2 CPU cores), ``qwen2-0.5b`` and ``qwen2-1.5b`` (the real
Qwen2 sizes, for a GPU); ``smollm2`` is SmolLM2-135M-Instruct itself (tests/smollm2.py,
``./steep install --dev``; vocabulary 49,152). Needs only torch, transformers (and peft for LoRA): no Ray,
no web app.

Time: ``step s`` is the fastest timed step's wall time (``perf/step_s``); ``CPU s`` its
CPU time (``time.process_time``, all threads of the process; summed over workers). On a
machine shared with other work, CPU seconds are the steadier measure of the work done
(idle OpenMP threads spin a little, which counts too).

Memory: ``peak`` is the trainer's ``perf/peak_memory_gb`` (CUDA: max allocated;
CPU: peak RSS of the process during the step, see ``rl_core.memory.PeakMemory``);
``step +`` is peak minus the memory held just before the step (activations,
gradients, optimizer state created in the step, temporaries). MFU (CUDA only):
model FLOPs of the step (8 N T for the proximal forward + forward/backward of the
N weights in linear layers, plus 8 * layers * heads * head_dim * sum(L_i^2) of causal
attention) / time / ``--peak-tflops``.

    python bench/train_step.py                      # CPU, small model, the standard cases
    python bench/train_step.py --model qwen2-0.5b --device cuda --tokens 8192,16384
    python bench/train_step.py --cases packed:fp32,dense:fp32 --tokens 2048 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.memory_plan import QWEN2  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "small": {
        "arch": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": None,  # the tiny byte-level tokenizer's
        "tie_word_embeddings": False,
    },
    "qwen2-0.5b": {
        "arch": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2-1.5b": {"arch": "qwen2", **QWEN2["1.5b"]},  # the memory plans' shape
    "qwen2-7b": {"arch": "qwen2", **QWEN2["7b"]},  # a LoRA step on one GPU (issue 35)
}

# attention:precision[:ckpt][:lora][:w2][:logits]
DEFAULT_CASES = (
    "dense:fp32,packed:fp32,packed:bf16,packed:fp32:ckpt,packed:fp32:lora,packed:fp32:w2"
)


@dataclass
class Case:
    attention: str  # "dense" | "packed"
    precision: str  # "fp32" | "bf16"
    tokens: int
    checkpointing: bool = False
    lora_rank: int = 0
    workers: int = 1
    full_logits: bool = False  # logprobs from the whole [T, V] logits (before issue 35)

    @property
    def name(self) -> str:
        parts = [self.attention, self.precision]
        parts += ["ckpt"] if self.checkpointing else []
        parts += [f"lora{self.lora_rank}"] if self.lora_rank else ["full"]
        parts += [f"{self.workers} workers"] if self.workers > 1 else []
        parts += ["T x V logits"] if self.full_logits else []
        return " ".join(parts)


def parse_cases(spec: str, tokens: list[int], lora_rank: int) -> list[Case]:
    cases = []
    for item in spec.split(","):
        attention, precision, *flags = item.strip().split(":")
        if attention not in ("dense", "packed") or precision not in ("fp32", "bf16"):
            raise SystemExit(f"bad case {item!r}: attention dense|packed, precision fp32|bf16")
        unknown = set(flags) - {"ckpt", "lora", "w2", "logits"}
        if unknown:
            raise SystemExit(
                f"bad case flags {sorted(unknown)} in {item!r}: use ckpt, lora, w2, logits"
            )
        for t in tokens:
            cases.append(
                Case(
                    attention,
                    precision,
                    t,
                    checkpointing="ckpt" in flags,
                    lora_rank=lora_rank if "lora" in flags else 0,
                    workers=2 if "w2" in flags else 1,
                    full_logits="logits" in flags,
                )
            )
    return cases


def build_model(name: str, root: Path) -> Path:
    """A random-weight model of preset ``name`` with the tiny tokenizer, built once under ``root``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from rl_core.tiny import TINY_VOCAB_SIZE, build_tiny_model

    if name == "smollm2":
        from tests.smollm2 import prepare_smollm2

        return prepare_smollm2()
    path = root / name
    if (path / "config.json").exists():
        return path
    spec = dict(MODELS[name])
    arch = spec.pop("arch")
    spec["vocab_size"] = spec["vocab_size"] or TINY_VOCAB_SIZE
    tiny = build_tiny_model(root / "tiny-tokenizer")
    config_cls = LlamaConfig if arch == "llama" else Qwen2Config
    config = config_cls(**spec, max_position_embeddings=32768, initializer_range=0.02)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    model.save_pretrained(tmp)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (tmp / f.name).write_bytes(f.read_bytes())
    tmp.rename(path)
    return path


def long_tailed_lengths(
    total: int, median: float, sigma: float, longest: int, seed: int
) -> list[int]:
    """Lognormal lengths (8 to min(longest, total / 2)) filling exactly ``total`` tokens."""
    import random

    rng = random.Random(seed)
    cap = min(longest, total // 2)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(min(cap, max(8, rng.lognormvariate(math.log(median), sigma))))
        left = total - sum(lengths)
        lengths.append(n if left - n >= 8 else left)
    return lengths


def make_batch(lengths: list[int], vocab: int, seed: int) -> list[Any]:
    import torch

    from rl_core.types import Trajectory

    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i, n in enumerate(lengths):
        prompt = max(1, n // 4)
        mask = [0] * prompt + [1] * (n - prompt)
        behaviour = (-3 * torch.rand(n, generator=g)).tolist()
        trajs.append(
            Trajectory(
                input_ids=torch.randint(0, vocab, (n,), generator=g).tolist(),
                loss_mask=mask,
                logprobs=[lp * m for lp, m in zip(behaviour, mask, strict=True)],
                versions=[0 if m else -1 for m in mask],
                rewards=[float(torch.rand((), generator=g))],
                group_id=str(i // 2),
            )
        )
    return trajs


def _linear_params(model: Any) -> int:
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def model_flops(model: Any, lengths: list[int]) -> float:
    """Useful FLOPs of one step: proximal forward (2) + forward/backward (6) per weight and token,
    plus causal attention (scores and values: 2 matmuls x 2 FLOPs x L^2 / 2, times 4 passes)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn_width = cfg.num_attention_heads * head_dim
    linear = 8.0 * _linear_params(model) * sum(lengths)
    attention = 8.0 * cfg.num_hidden_layers * attn_width * sum(n * n for n in lengths)
    return linear + attention


def run_case(case: Case, args: argparse.Namespace, model_dir: str, rank: int = 0) -> dict:
    """Build a trainer for ``case``, run ``--warmup`` + ``--steps`` steps; rank 0's measurements."""
    import torch

    from rl_core.config import RunConfig
    from rl_core.memory import PeakMemory
    from rl_core.trainer import PPOTrainer

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if case.full_logits:
        import functools

        import rl_core.trainer
        from rl_core.packing import packed_logprobs

        rl_core.trainer.packed_logprobs = functools.partial(packed_logprobs, from_hidden=False)
    cfg: dict[str, Any] = {
        "base_model": model_dir,
        "mode": "online",
        "learning_rate": 1e-5,
        "micro_batch_tokens": case.tokens,
        "ppo_minibatches": 1,
        "precision": case.precision,
        "gradient_checkpointing": case.checkpointing,
        "seed": 0,
    }
    if case.lora_rank:
        cfg["lora_rank"] = case.lora_rank
    lengths = long_tailed_lengths(case.tokens, args.median, args.sigma, args.max_len, seed=0)
    cfg["batch_size"] = len(lengths)
    trainer = PPOTrainer(RunConfig.from_dict(cfg), device=device)
    trainable = sum(p.numel() for p in trainer.params)
    total = sum(p.numel() for p in trainer.model.parameters())
    if case.lora_rank and trainable == total:
        return {"status": "not available in this build (the trainer trains every weight)"}
    if case.attention == "dense":  # the pre-#13 path: sdpa with the T x T block mask
        for model in (trainer.model, trainer.ref_model):
            if model is not None:
                model.config._attn_implementation = "sdpa"
    batch = make_batch(lengths, trainer.model.config.vocab_size, seed=1)
    for _ in range(args.warmup):
        trainer.train_step(batch)
    seconds, cpu_seconds, peaks, growth = [], [], [], []
    for _ in range(args.steps):
        before = PeakMemory(device).start().start_gb
        cpu_started = time.process_time()
        stats = trainer.train_step(batch)
        cpu_seconds.append(time.process_time() - cpu_started)
        seconds.append(stats["perf/step_s"])
        peaks.append(stats["perf/peak_memory_gb"])
        growth.append(stats["perf/peak_memory_gb"] - before)
    step_s = min(seconds)
    flops = model_flops(trainer.model, lengths)
    result = {
        "status": "ok",
        "sequences": len(lengths),
        "longest": max(lengths),
        "step_s": step_s,
        "tokens_per_s": case.tokens / step_s,
        "cpu_s": min(cpu_seconds),
        "peak_memory_gb": max(peaks),
        "step_memory_gb": max(growth),
        "trainable_params": trainable,
        "tflops_per_s": flops / step_s / 1e12,
        "mfu": flops / step_s / (args.peak_tflops * 1e12) if device.type == "cuda" else None,
        "precision": trainer.precision,
        "attn_implementation": trainer.model.config._attn_implementation,
    }
    return result


def _case_process(case: Case, args: argparse.Namespace, model_dir: str, out: str) -> None:
    result = run_case(case, args, model_dir)
    Path(out).write_text(json.dumps(result))


def _ddp_process(
    rank: int, case: Case, args: argparse.Namespace, model_dir: str, store: str, out: str
) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=case.workers,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        result = run_case(case, args, model_dir, rank)
        Path(f"{out}.{rank}").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_isolated(case: Case, args: argparse.Namespace, model_dir: str, tmp: Path) -> dict:
    import torch.multiprocessing as mp

    out = str(tmp / f"result-{abs(hash(case.name))}-{case.tokens}.json")
    ctx = mp.get_context("spawn")
    if case.workers == 1:
        proc = ctx.Process(target=_case_process, args=(case, args, model_dir, out))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            return {"status": f"failed (exit code {proc.exitcode})"}
        return json.loads(Path(out).read_text())
    store = tmp / f"store-{case.tokens}-{time.monotonic_ns()}"
    procs = [
        ctx.Process(target=_ddp_process, args=(r, case, args, model_dir, str(store), out))
        for r in range(case.workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        return {"status": f"failed (exit codes {[p.exitcode for p in procs]})"}
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(case.workers)]
    merged = dict(results[0])
    # Every rank takes part in every all-reduce, so the slowest one sets the pace.
    merged["step_s"] = max(r["step_s"] for r in results)
    merged["tokens_per_s"] = case.tokens / merged["step_s"]
    merged["cpu_s"] = sum(r["cpu_s"] for r in results)
    merged["peak_memory_gb"] = max(r["peak_memory_gb"] for r in results)
    merged["step_memory_gb"] = max(r["step_memory_gb"] for r in results)
    return merged


# Real sizes (config.json of Qwen2-0.5B, Qwen2-1.5B, Qwen2-7B, Qwen2.5-32B):
# hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings.
ARITHMETIC_MODELS = {
    "0.5B (Qwen2-0.5B)": (896, 24, 14, 2, 4864, 151936, True),
    "1.5B (Qwen2-1.5B)": (1536, 28, 12, 2, 8960, 151936, True),
    "7B (Qwen2-7B)": (3584, 28, 28, 4, 18944, 152064, False),
    "32B (Qwen2.5-32B)": (5120, 64, 40, 8, 27648, 152064, False),
}


def memory_table(workers: tuple[int, ...] = (1, 2, 8), ranks: tuple[int, ...] = (8, 64)) -> str:
    """Weights + gradients + AdamW state per worker, in GB, as the trainer holds them.

    Full: float32 master weights (4 B), float32 gradients (4 B), AdamW m and v (8 B) =
    16 B per parameter; bf16 compute only adds transient bf16 copies of the layer in
    use. LoRA on every linear layer: the frozen base stays float32 as loaded (4 B, no
    gradient or optimizer state), the adapter costs 16 B per parameter. FSDP2 shards
    all of it over the workers. Activations come on top (measured above).
    """
    head = "| model | params | " + " | ".join(
        f"{kind}, {n} worker{'s' if n > 1 else ''}"
        for kind in ["full", *(f"LoRA r{r}" for r in ranks)]
        for n in workers
    )
    lines = [head + " |", "|---|---:|" + "---:|" * (len(workers) * (1 + len(ranks)))]
    for name, (h, layers, heads, kv, inter, vocab, tied) in ARITHMETIC_MODELS.items():
        d = h // heads
        attn = h * heads * d + 2 * h * kv * d + heads * d * h + (heads + 2 * kv) * d  # q,k,v,o,bias
        mlp = 3 * h * inter
        params = layers * (attn + mlp + 2 * h) + vocab * h * (1 if tied else 2) + h
        # (in + out) * r for q, k, v, o, gate, up, down
        lora_per_rank = layers * (
            (h + heads * d) * 2 + (h + kv * d) * 2 + (h + inter) * 2 + (inter + h)
        )
        cells = [16 * params / n / 1e9 for n in workers]
        for r in ranks:
            cells += [(4 * params + 16 * r * lora_per_rank) / n / 1e9 for n in workers]
        lines.append(
            f"| {name} | {params / 1e9:.2f} B | " + " | ".join(f"{c:,.1f}" for c in cells) + " |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| case | T | seqs (longest) | step s | tokens/s | CPU s | tokens/CPU s | peak GB "
        "| step + GB | TFLOP/s | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        r = row["result"]
        if r["status"] != "ok":
            lines.append(f"| {row['case']} | {row['tokens']} | {r['status']} ||||||||| |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "—"
        lines.append(
            f"| {row['case']} | {row['tokens']} | {r['sequences']} ({r['longest']}) "
            f"| {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['cpu_s']:.1f} "
            f"| {row['tokens'] / r['cpu_s']:,.0f} | {r['peak_memory_gb']:.2f} "
            f"| {r['step_memory_gb']:.2f} | {r['tflops_per_s']:.3f} | {mfu} |"
        )
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    ok = {(r["case"], r["tokens"]): r["result"] for r in rows if r["result"]["status"] == "ok"}
    out = []
    for tokens in sorted({t for _, t in ok}):
        dense = ok.get(("dense fp32 full", tokens))
        packed = ok.get(("packed fp32 full", tokens))
        if dense and packed:
            ratio = packed["tokens_per_s"] / dense["tokens_per_s"]
            cpu_ratio = dense["cpu_s"] / packed["cpu_s"]
            goal = " (goal >= 1.5x: met)" if ratio >= 1.5 else " (goal >= 1.5x: not met)"
            out.append(
                f"T={tokens}: packed / dense tokens/s = {ratio:.2f}x{goal if tokens >= 8192 else ''}, "
                f"per CPU second {cpu_ratio:.2f}x; "
                f"step memory {packed['step_memory_gb']:.2f} vs {dense['step_memory_gb']:.2f} GB"
            )
    for name in sorted({c for c, _ in ok}):
        sizes = sorted(t for c, t in ok if c == name)
        for a, b in zip(sizes, sizes[1:], strict=False):
            if b == 2 * a:
                ma, mb = ok[(name, a)]["step_memory_gb"], ok[(name, b)]["step_memory_gb"]
                out.append(
                    f"{name}: step memory at T={a} {ma:.2f} GB, at 2T={b} {mb:.2f} GB "
                    f"(x{mb / ma:.2f}; linear = x2, quadratic = x4)"
                    if ma > 0
                    else f"{name}: step memory at T={a} not measurable"
                )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*sorted(MODELS), "smollm2"], default="small")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--tokens", default="2048,8192", help="micro-batch sizes T, comma-separated"
    )
    parser.add_argument(
        "--cases",
        default=DEFAULT_CASES,
        help="attention:precision[:ckpt][:lora][:w2][:logits],...",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=8, help="RunConfig.lora_rank of :lora cases"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker (1: steady timings on a shared machine)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--steps", type=int, default=1, help="timed steps (the fastest is reported)"
    )
    parser.add_argument("--median", type=float, default=160.0, help="median sequence length")
    parser.add_argument("--max-len", type=int, default=2048, help="longest sequence")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device peak bf16 TFLOP/s")
    parser.add_argument(
        "--workdir", default=str(Path(tempfile.gettempdir()) / "steep-bench-train-step")
    )
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument(
        "--memory-table", action="store_true", help="print the weights/optimizer arithmetic only"
    )
    args = parser.parse_args(argv)
    if args.memory_table:
        print(memory_table())
        return
    # Return freed memory to the OS at once, so RSS peaks of one step are that step's.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # read at import by workers
    tokens = [int(t) for t in args.tokens.split(",")]
    cases = parse_cases(args.cases, tokens, args.lora_rank)
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    model_dir = str(build_model(args.model, root))
    load = os.getloadavg()
    header = (
        f"model {args.model}, device {args.device}, {args.threads} thread(s) per worker, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average before {load[0]:.2f}"
    )
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp:
        for case in cases:
            started = time.perf_counter()
            result = run_isolated(case, args, model_dir, Path(tmp))
            rows.append(
                {
                    "case": case.name,
                    "tokens": case.tokens,
                    **{"config": asdict(case)},
                    "result": result,
                }
            )
            print(
                f"  {case.name} T={case.tokens}: {result.get('status')} "
                f"({time.perf_counter() - started:.0f} s wall)",
                flush=True,
            )
    load_after = os.getloadavg()
    print()
    print(markdown(rows))
    print()
    for line in verdicts(rows):
        print("- " + line)
    print(f"\nload average after {load_after[0]:.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"header": header, "load_after": load_after[0], "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
