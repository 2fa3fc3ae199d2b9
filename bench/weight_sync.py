"""Weight sync per update: bytes, transfer seconds, and how long inference stood still.

    nice -n 19 .venv/bin/python bench/weight_sync.py [--model tiny|smollm2|PATH] [--updates 5]
        [--strategies disk,distributed] [--threads 2] [--out results.json]

For each strategy (``rl_core.weight_sync``): one torch-engine server and one
``PPOTrainer`` on the same model; a client streams tokens continuously (one long
greedy generation after another) while the trainer's weights are perturbed and pushed
``--updates`` times. Per update it reports what ``WeightSync`` measured
(``weight_sync/bytes``, ``timing/weight_transfer``, ``timing/inference_stall``,
``timing/weight_sync``) and, measured from the outside, the longest gap between two
streamed tokens during the push against the median gap outside pushes: the stall a
client sees. ``smollm2`` is SmolLM2-135M-Instruct as ``bench/real_model.py`` builds it
under ``.steep/bench/models/``.

``STRATEGIES`` maps a column name to a factory ``(urls, weights_dir) -> WeightSync-like``
(anything with ``push(trainer)``, ``last_timing`` and ``aclose()``): add a LoRA-adapter
column there once adapter serving exists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_core.config import RunConfig  # noqa: E402
from rl_core.inference.client import InferenceClient  # noqa: E402
from rl_core.inference.launch import TorchEngineServer  # noqa: E402
from rl_core.weight_sync import WeightSync  # noqa: E402

SMOLLM2 = ROOT / ".steep" / "bench" / "models" / "smollm2-135m-instruct"

STRATEGIES: dict[str, Callable[[list[str], Path], Any]] = {
    "disk": lambda urls, d: WeightSync(urls, d, strategy="disk"),
    "distributed": lambda urls, d: WeightSync(urls, d, strategy="distributed"),
    # "lora_adapter": lambda urls, d: AdapterSync(urls, d),  # hook for adapter serving
}


def model_dir(name: str, work: Path) -> Path:
    if name == "tiny":
        from rl_core.tiny import build_tiny_model

        return build_tiny_model(work / "tiny-model")
    if name == "smollm2":
        if not SMOLLM2.is_dir():
            raise SystemExit(f"{SMOLLM2} is missing: run bench/real_model.py once to build it")
        return SMOLLM2
    return Path(name)


class TokenClock:
    """Streams greedy generations back to back and records when each token arrived."""

    def __init__(self, url: str):
        self.client = InferenceClient(url)
        self.times: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            stream = self.client.generate_stream(
                [1, 2, 3, 4], {"max_new_tokens": 4096, "temperature": 0, "ignore_eos": True}
            )
            async for chunk in stream:
                now = time.perf_counter()
                self.times += [now] * len(chunk.output_ids)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait for a token that overlaps [start, end] (a push)."""
        gaps = [
            b - a
            for a, b in zip(self.times, self.times[1:], strict=False)
            if b >= start and a <= end
        ]
        return max(gaps, default=end - start)

    def median_gap(self, windows: list[tuple[float, float]]) -> float:
        gaps = [
            b - a
            for a, b in zip(self.times, self.times[1:], strict=False)
            if b > a and not any(b >= s and a <= e for s, e in windows)
        ]
        return statistics.median(gaps) if gaps else float("nan")


async def bench_strategy(name: str, model: Path, args: argparse.Namespace, work: Path) -> dict:
    import torch

    from rl_core.trainer import PPOTrainer

    server = TorchEngineServer(model, host="127.0.0.1", weight_version=0, num_threads=args.threads)
    server.start()
    try:
        server.wait_healthy(timeout=300)
        cfg = RunConfig.from_dict({"base_model": str(model), "reward": {"type": "exact_match"}})
        trainer = PPOTrainer(cfg, device="cpu")
        sync = STRATEGIES[name]([server.url], work / f"weights-{name}")
        clock = TokenClock(server.url)
        clock.start()
        await asyncio.sleep(2.0)  # a baseline of undisturbed tokens
        updates, windows = [], []
        try:
            for i in range(args.updates):
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.mul_(1.0 + 1e-3 * (i + 1))
                trainer.version += 1
                start = time.perf_counter()
                await sync.push(trainer)
                end = time.perf_counter()
                windows.append((start, end))
                await asyncio.sleep(1.0)  # tokens after the push close the last gap
                updates.append(
                    {
                        **{k: round(v, 4) for k, v in sync.last_timing.items()},
                        "client_longest_token_gap_s": round(clock.longest_gap(start, end), 4),
                    }
                )
        finally:
            await clock.stop()
            await sync.aclose()
        return {
            "strategy": name,
            "median_token_gap_s": round(clock.median_gap(windows), 4),
            "updates": updates,
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model directory")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="steep-bench-wsync-") as tmp:
        work = Path(tmp)
        model = model_dir(args.model, work)
        results = {
            "model": str(model),
            "strategies": [
                asyncio.run(bench_strategy(name, model, args, work))
                for name in args.strategies.split(",")
            ],
        }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for r in results["strategies"]:
        ups = r["updates"]
        print(
            f"{r['strategy']:>12}: bytes {statistics.median(u['weight_sync/bytes'] for u in ups):,.0f}"
            f"  transfer {statistics.median(u['timing/weight_transfer'] for u in ups):.3f}s"
            f"  engine stall {statistics.median(u['timing/inference_stall'] for u in ups):.4f}s"
            f"  client gap {statistics.median(u['client_longest_token_gap_s'] for u in ups):.3f}s"
            f" (median gap {r['median_token_gap_s']:.3f}s)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
