"""The torch engine's decode step and a weight file's disk round trip: figures for the cost model.

    python bench/engine_step.py --model qwen2-1.5b --device cuda --dtype bfloat16 \\
        [--batches 1,8,32,128] [--prompts 128,1024] [--steps 32] [--json out.json]

``rl_core/sim/cost.py`` models a decode step as ``base_s + per_seq_s * B + per_kv_token_s * K``
(B running requests, K cached tokens). This measures Steep's own torch engine (in process, no
HTTP) on a random-weight preset of ``bench/train_step.py``: for each batch B and prompt length
P, B requests of P tokens are admitted together twice, once for 1 new token (the prefill and
the first sample) and once for ``1 + --steps``, all ``ignore_eos``; the difference over
``--steps`` is one decode step at B rows with about ``B * (P + steps / 2)`` cached tokens. A
least-squares fit of every (B, K, step) gives the three coefficients, printed as an
``EngineCost`` line beside the measured table. Prefill per token is the first run's time over
its ``B * P`` prompt tokens, at the largest batch.

Also timed: writing the preset's weights in the engine's dtype as safetensors (with fsync) and
reading them back onto the device, bytes/s: the ``disk`` weight-sync path's two legs on this
machine's local disk.

``--adapters N`` loads N random rank-8 LoRA adapters (``bench/pool.py``'s) and spreads the
requests over them, as a shared pool's batch is; ``--vocab`` shrinks the preset's vocabulary
(the engine samples on the CPU: a 152k vocabulary costs per row what the forward does not);
``--profile PATH`` drives the scheduler from this thread under cProfile for one cell (the
largest batch, the first prompt length) and writes the top functions there instead;
``--no-cudnn-sdp`` turns SDPA's cuDNN backend off (on the H200, 2026-11-27, a decode step's
``scaled_dot_product_attention`` calls held 1.5-3.5 ms of host time each: this tells whether
that is cuDNN building a graph for every new KV length).

Random weights, so no output is meaningful; the work per step is the real model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def timed_batch(
    engine, tokenizer, batch: int, prompt: int, new: int, seed: int, adapters: int = 0
) -> float:
    """Seconds from submitting ``batch`` requests of ``prompt`` tokens to the last finishing."""
    from rl_core.inference.torch_engine.protocol import parse_generate_request

    done = threading.Event()
    left = [batch]
    lock = threading.Lock()

    def sink(payload: dict, final: bool) -> None:
        if final:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    started = time.perf_counter()
    for i in range(batch):
        ids = [(seed * 7919 + i * 131 + j * 17) % 250 + 3 for j in range(prompt)]
        body = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": new,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": seed + i,
            },
        }
        if adapters:
            body["lora_path"] = f"run{i % adapters}"
        req = parse_generate_request(body, tokenizer=tokenizer, vocab_size=engine.vocab_size)
        req.sink = sink
        engine.submit(req)
    if not engine.is_alive():  # --profile: this thread runs the scheduler
        while engine._running or engine._waiting:
            engine._step()
    if not done.wait(600):
        raise TimeoutError(f"batch {batch} x {prompt} tokens did not finish")
    return time.perf_counter() - started


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares of ``step = a + b * B + c * K`` over (B, K, step) points."""
    import torch

    x = torch.tensor([[1.0, b, k] for b, k, _ in points], dtype=torch.float64)
    y = torch.tensor([[s] for _, _, s in points], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y).solution[:, 0].tolist()
    return coef[0], coef[1], coef[2]


def disk_round_trip(model, dtype, device: str, work: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")} or state
    size = sum(v.numel() * v.element_size() for v in state.values())
    path = work / "weights.safetensors"
    start = time.perf_counter()
    save_file(state, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    loaded = load_file(str(path), device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    read_s = time.perf_counter() - start
    del loaded
    path.unlink()
    return {"bytes": size, "write_Bps": size / write_s, "read_Bps": size / read_s}


def profile(engine, tokenizer, args) -> None:
    """One cell's scheduler steps under cProfile, in this thread: where a decode step goes."""
    import cProfile
    import io
    import pstats

    import torch

    torch.set_grad_enabled(False)
    batch = max(int(b) for b in args.batches.split(","))
    prompt = int(args.prompts.split(",")[0])
    timed_batch(engine, tokenizer, batch, prompt, 4, 1, args.adapters)  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    seconds = timed_batch(engine, tokenizer, batch, prompt, 1 + args.steps, 2, args.adapters)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    head = (
        f"{args.model}, {args.adapters} adapters, B {batch}, P {prompt}, {args.steps} steps: "
        f"{seconds:.3f} s under cProfile ({seconds / args.steps * 1e3:.1f} ms per step, "
        f"prefill included)\n"
    )
    Path(args.profile).write_text(head + text.getvalue())
    print(head)


def main(argv: list[str] | None = None) -> None:
    import torch
    import train_step
    from transformers import AutoTokenizer

    from rl_core.inference.torch_engine.engine import TorchEngine, load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(train_step.MODELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--prompts", default="128,1024")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per cell")
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "steep-bench-step"))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--vocab", type=int, default=0, help="the preset's vocabulary (0: its own)")
    parser.add_argument("--adapters", type=int, default=0, help="LoRA adapters the batch mixes")
    parser.add_argument("--profile", help="cProfile one cell's scheduler steps; top functions here")
    parser.add_argument(
        "--no-cudnn-sdp",
        action="store_true",
        help="turn off SDPA's cuDNN backend (torch.backends.cuda.enable_cudnn_sdp(False))",
    )
    args = parser.parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.vocab:
        name = f"{args.model}-v{args.vocab}"
        train_step.MODELS[name] = {**train_step.MODELS[args.model], "vocab_size": args.vocab}
        args.model = name
    model_dir = train_step.build_model(args.model, work)
    model = load_model(str(model_dir), dtype=dtype, device=args.device)
    params = sum(p.numel() for p in model.parameters())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lora = None
    if args.adapters:
        from pool import make_adapters

        from rl_core.inference.torch_engine.lora import AdapterSet

        lora = AdapterSet(model, max_lora_rank=8, max_loras_per_batch=args.adapters)
        for i, path in enumerate(make_adapters(model_dir, work / "adapters", args.adapters)):
            lora.load(f"run{i}", str(path))
    engine = TorchEngine(
        model,
        tokenizer,
        model_path=str(model_dir),
        max_running_requests=args.max_running_requests,
        adapters=lora,
    )
    if args.profile:
        profile(engine, tokenizer, args)
        return
    engine.start()
    rows, points = [], []
    try:
        timed_batch(engine, tokenizer, 4, 64, 8, seed=0)  # warm-up: kernels, allocator
        for prompt in (int(p) for p in args.prompts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                first = timed_batch(engine, tokenizer, batch, prompt, 1, batch, args.adapters)
                total = timed_batch(
                    engine, tokenizer, batch, prompt, 1 + args.steps, batch, args.adapters
                )
                step = max(0.0, total - first) / args.steps
                kv = batch * (prompt + args.steps // 2)
                rows.append(
                    {"batch": batch, "prompt": prompt, "kv_tokens": kv, "step_s": step,
                     "prefill_s": first, "tokens_per_s": batch / step if step else 0.0}
                )  # fmt: skip
                points.append((batch, kv, step))
                print(
                    f"B {batch:>4} P {prompt:>5}: step {step * 1e3:8.2f} ms "
                    f"({batch / step if step else 0:9.0f} tok/s), prefill {first:6.3f} s",
                    flush=True,
                )
    finally:
        engine.stop()
    base, per_seq, per_kv = fit(points)
    largest = max(rows, key=lambda r: r["batch"] * r["prompt"])
    prefill_per_token = largest["prefill_s"] / (largest["batch"] * largest["prompt"])
    disk = disk_round_trip(model, dtype, args.device, work)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {
        "model": args.model, "params": params, "device": device_name, "dtype": args.dtype,
        "rows": rows, "base_s": base, "per_seq_s": per_seq, "per_kv_token_s": per_kv,
        "prefill_per_token_s": prefill_per_token, "disk": disk,
    }  # fmt: skip
    print(
        f"\n{args.model} ({params / 1e9:.2f} B params) on {device_name}, {args.dtype}: "
        f"EngineCost(base_s={base:.3e}, per_seq_s={per_seq:.3e}, per_kv_token_s={per_kv:.3e}, "
        f"prefill_per_token_s={prefill_per_token:.3e})"
    )
    print(
        f"disk: {disk['bytes'] / 1e9:.2f} GB written at {disk['write_Bps'] / 1e9:.2f} GB/s "
        f"(fsync), read onto {args.device} at {disk['read_Bps'] / 1e9:.2f} GB/s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
