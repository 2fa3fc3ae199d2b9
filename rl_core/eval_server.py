"""An evaluation's answers sampled by an inference server, the way the rollouts sample them.

``python -m rl_core.evaluate ... --engine server`` (``auto`` on a CUDA machine): instead of a
float32 model in the evaluation's own process (unusable from 7B), a server of the run's
backend (``--backend``: the torch engine, SGLang or vLLM, ``rl_core.inference.launch``) is
started for the evaluation on the model it was asked about. A checkpoint is exported first
(``rl_core.export``: streamed, a LoRA adapter merged, cast to the base model's dtype), so the
server loads what the run's servers would. Each answer is one ``/generate`` request with the
rollouts' sampling parameters (temperature, nucleus, the tokenizer's stop ids) and seed
(``member_seed(seed, row, answer)``), ``concurrency`` answers in flight; the server batches
them. A server of its own keeps the evaluation's answers on one set of weights and off the
run's servers (see ``rl_core.evaluate``). Stopped, and the export removed, at the end.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rl_core import lora
from rl_core.chat import ChatTokenizer
from rl_core.rollout import member_seed, row_messages

CONCURRENCY = 32  # answers in flight on the evaluation's server


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A run's checkpoint (full or LoRA), rather than a model folder a server loads as it is."""
    from rl_core.trainer_saving import TRAINER_STATE

    return lora.is_lora_checkpoint(path) or (Path(path) / TRAINER_STATE).is_file()


@contextmanager
def served(
    model_path: str | os.PathLike, backend: str, workdir: Path, **server_kwargs: Any
) -> Iterator[Any]:
    """A started server of ``backend`` on ``model_path`` (a checkpoint exported into ``workdir``
    first), and its client; stopped, and the export removed, on exit."""
    from rl_core.export import export_checkpoint
    from rl_core.inference.launch import make_inference_server
    from rl_core.inference.vllm import client_for, vllm_cpu_settings

    exported = workdir / "served-model"
    path = export_checkpoint(model_path, exported) if is_checkpoint(model_path) else model_path
    kwargs = dict(server_kwargs)
    if backend == "vllm" and not _cuda():
        kwargs |= vllm_cpu_settings()
    kwargs.setdefault("log_path", workdir / "server.log")
    server = make_inference_server(backend, path, **kwargs)
    try:
        server.start()
        print(f"server {server.backend} {server.url}", flush=True)
        server.wait_healthy(timeout=float(os.environ.get("STEEP_SERVER_START_TIMEOUT", "600")))
        yield client_for(server.backend, server.url)
    finally:
        server.stop()
        shutil.rmtree(exported, ignore_errors=True)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sample_rows(
    client: Any,
    tokenizer: ChatTokenizer,
    rows: list[dict[str, Any]],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    on_row: Callable[[int, str, list[list[int]]], None],
    concurrency: int = CONCURRENCY,
) -> None:
    """Sample ``k`` answers to each row's prompt on the server; ``on_row(index, prompt_text,
    answers)`` for each row, in row order, as soon as it and every row before it are done."""

    async def run() -> None:
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop_token_ids": list(tokenizer.eos_token_ids),
        }
        slots = asyncio.Semaphore(concurrency)

        async def answer(prompt: list[int], index: int, member: int) -> list[int]:
            async with slots:
                result = await client.generate(
                    prompt,
                    {**params, "sampling_seed": member_seed(seed, index, member)},
                    return_logprob=False,
                )
            return list(result.output_ids)

        async def row_answers(index: int) -> tuple[str, list[list[int]]]:
            text = tokenizer.render(row_messages(rows[index]))
            prompt = tokenizer.encode(text)
            return text, list(await asyncio.gather(*(answer(prompt, index, m) for m in range(k))))

        try:
            # Rows are started in order, at most a window of them at once, and reported in order.
            window = max(1, concurrency // max(1, k)) * 2
            pending: dict[int, asyncio.Task] = {}
            started = 0
            for index in range(len(rows)):
                while started < len(rows) and started < index + window:
                    pending[started] = asyncio.create_task(row_answers(started))
                    started += 1
                text, answers = await pending.pop(index)
                on_row(index, text, answers)
        finally:
            for task in pending.values():
                task.cancel()
            await client.aclose()

    asyncio.run(run())
