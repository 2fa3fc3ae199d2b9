"""``python -m rl_core.inference.torch_engine``: serve a model over SGLang's native HTTP API.

    python -m rl_core.inference.torch_engine --model-path PATH --port 30000 \\
        [--host 127.0.0.1] [--max-running-requests 32] [--weight-version 0] \\
        [--num-threads N] [--dtype float32] [--device cpu] [--context-length N] \\
        [--parent-pid PID] [--enable-lora [--max-lora-rank R] [--lora-target-modules M ...]
        [--max-loras-per-batch N] [--max-loaded-loras N]]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal

import torch
from aiohttp import web

from rl_core.inference.process import when_parent_exits
from rl_core.inference.torch_engine.engine import TorchEngine, load_model
from rl_core.inference.torch_engine.lora import AdapterSet
from rl_core.inference.torch_engine.prefill import MAX_PREFILL_TOKENS
from rl_core.inference.torch_engine.prefix_cache import DEFAULT_MAX_MB
from rl_core.inference.torch_engine.server import build_app

logger = logging.getLogger("rl_core.inference.torch_engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rl_core.inference.torch_engine",
        description="Serve a causal LM over SGLang's native HTTP API with plain PyTorch.",
    )
    parser.add_argument(
        "--model-path", required=True, help="Local directory with the model and tokenizer."
    )
    parser.add_argument(
        "--tokenizer-path", default=None, help="Tokenizer directory (default: --model-path)."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--max-running-requests", type=int, default=32, help="Largest decode batch."
    )
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=MAX_PREFILL_TOKENS,
        help="Most padded prompt tokens in one prefill forward (prompts admitted together "
        "are prefilled together).",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=DEFAULT_MAX_MB,
        help="MiB of finished requests' KV kept for requests that begin the same way (a "
        "session's next turn, a group's prompt); least recently used first out (prefix_cache.py).",
    )
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="SGLang's flag: keep no prefix cache (every prompt prefilled whole).",
    )
    parser.add_argument(
        "--weight-version", default="default", help="Reported as meta_info.weight_version."
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="Default: the model's max_position_embeddings.",
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", choices=["auto", *_DTYPES], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--no-cudnn-attention",
        action="store_true",
        help="Turn off the cuDNN backend of PyTorch's scaled_dot_product_attention (CUDA): on "
        "an H200 a decode step's attention calls held 1.5-3.5 ms of host time each, a lead to "
        "cuDNN building a graph per new KV length (docs/benchmarks/gpu.md).",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=int(os.environ.get("STEEP_TORCH_THREADS", "0")) or None,
        help="torch intra-op threads (default: $STEEP_TORCH_THREADS, else torch's default).",
    )
    parser.add_argument(
        "--random-seed", type=int, default=None, help="Seed for requests without sampling_seed."
    )
    parser.add_argument("--log-level", default="info")
    # SGLang's LoRA flags (rl_core/inference/torch_engine/lora.py).
    parser.add_argument(
        "--enable-lora", action="store_true", help="Serve LoRA adapters (/load_lora_adapter)."
    )
    parser.add_argument(
        "--max-lora-rank", type=int, default=None, help="Refuse adapters of a higher rank."
    )
    parser.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        help="Module names that may carry an adapter (e.g. q_proj v_proj), or 'all' (default).",
    )
    parser.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="Most distinct adapters in one running batch; more wait.",
    )
    parser.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="Most adapters held in memory; loading one more evicts the least recently used "
        "idle one, reloaded from its path when a request names it (default: no limit).",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="Shut down when this process, the one that started the server, is gone: the "
        "server runs in a session of its own, so nothing else stops it when its owner is killed.",
    )
    return parser.parse_args(argv)


def _exit_with_parent(parent: int) -> None:
    """SIGTERM ourselves (a graceful stop once serving) once ``parent`` is no longer our parent."""

    def stop() -> None:
        logger.warning("the process that started this server (%d) exited: shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    when_parent_exits(parent, stop)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.random_seed is not None:
        random.seed(args.random_seed)
    from transformers import AutoTokenizer

    dtype = torch.float32 if args.dtype in ("auto", "float32") else _DTYPES[args.dtype]
    model = load_model(args.model_path, dtype=dtype, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    server_args = {k: v for k, v in vars(args).items() if k != "log_level"}
    server_args["tokenizer_path"] = args.tokenizer_path or args.model_path
    adapters = None
    if args.enable_lora or args.lora_target_modules or args.max_lora_rank:
        adapters = AdapterSet(
            model,
            target_modules=args.lora_target_modules,
            max_lora_rank=args.max_lora_rank,
            max_loras_per_batch=args.max_loras_per_batch,
            max_loaded_loras=args.max_loaded_loras,
        )
    engine = TorchEngine(
        model,
        tokenizer,
        model_path=args.model_path,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        weight_version=args.weight_version,
        context_length=args.context_length,
        served_model_name=args.served_model_name,
        server_args=server_args,
        adapters=adapters,
        prefix_cache_mb=0 if args.disable_radix_cache else args.prefix_cache_mb,
    )
    engine.start()
    logger.info(
        "serving %s (weight version %s) on http://%s:%d",
        args.model_path,
        engine.weight_version,
        args.host,
        args.port,
    )
    web.run_app(
        build_app(engine),
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
