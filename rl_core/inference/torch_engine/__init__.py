"""The torch engine: SGLang's native HTTP API served by a plain transformers model.

CPU machines (laptops, CI) cannot run SGLang, so Steep ships this small engine
that speaks the same protocol; everything above it (the client, the gateway,
the rollout driver, weight sync) runs the code path it runs against SGLang.

    python -m rl_core.inference.torch_engine --model-path PATH --port 30000 \\
        [--host 127.0.0.1] [--max-running-requests 32] [--weight-version 0] \\
        [--num-threads N] [--dtype float32] [--device cpu] [--context-length N]

Endpoints (field names as SGLang's ``http_server.py`` / ``io_struct.py``):
``POST /generate`` (``input_ids`` or ``text``, ``sampling_params``, ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``, ``rid``,
``stream``), ``POST /pause_generation`` (``mode: "abort"``), ``POST /continue_generation``,
``POST /update_weights_from_disk`` (``model_path``, ``weight_version``,
``abort_all_requests``), ``POST /init_weights_update_group``,
``POST /update_weights_from_distributed``, ``POST /destroy_weights_update_group``
(``weight_update``), ``POST /abort_request``, ``POST /slow_down``,
``GET|POST /flush_cache``, ``GET /health``, ``GET /health_generate``,
``GET /get_model_info`` = ``/model_info``, ``GET /get_server_info`` = ``/server_info``,
``GET /get_weight_version`` = ``/weight_version``, ``GET /v1/models``; LoRA:
``POST /load_lora_adapter``, ``POST /unload_lora_adapter`` (``lora.py``, with
``--max-loaded-loras`` evicting idle adapters and reloading them on demand); Steep's own
``POST /set_fair_share_weights`` (per-run weights of the batch's fair share, ``fair.py``).

Semantics that RL relies on:

* ``meta_info.output_token_logprobs`` holds ``[logprob, token_id, text|None]`` per
  output token, where ``logprob`` is ``log_softmax(logits / temperature)`` at that
  position (before top-k/top-p/min-p; temperature 1 for a greedy request), as SGLang
  reports it by default: what the trainer recomputes with each token's temperature
  (``rl_core.sampling``). Prompt logprobs (``logprob_start_len``) are of the raw logits;
  with ``top_logprobs_num`` k, ``input_top_logprobs`` holds each prompt token's k best
  ``[logprob, id, text|None]`` (None for the first token), as SGLang's: a distillation
  teacher's top-k (``rl_core.distill_topk``).
* A weight update (``/update_weights_from_disk`` or ``/update_weights_from_distributed``)
  loads or receives the new weights beside generation and swaps them in between two
  decode steps; requests in flight go on under the new weights. ``meta_info.
  weight_versions`` (as newer SGLang) lists spans ``{"version", "start", "end"}`` of
  output tokens by the version that produced them, and ``meta_info.weight_version``
  is the last token's version.
* ``/pause_generation`` aborts every running and queued request; each returns
  ``finish_reason {"type": "abort"}`` with the tokens generated so far. Requests
  that arrive while paused wait until ``/continue_generation``.

Scheduling is continuous batching over a left-padded KV cache, admitting waiting requests
by a weighted fair share per run (``fair.py``; server info reports per-run figures); model compute
never runs on the HTTP event loop. Targets full-attention decoder models (Llama,
Qwen2/3, Mistral without sliding window); models with sliding-window or
recurrent layers are not supported.

The package: ``protocol`` (SGLang's request and response bodies), ``engine`` (the
model, the scheduler thread, weight updates), ``kv_cache`` (the running batch's
left-padded cache), ``server`` (the HTTP routes), ``weight_update`` (the distributed weight update), ``__main__`` (the command line).
"""

from rl_core.inference.torch_engine.engine import EngineStopped, TorchEngine, load_model
from rl_core.inference.torch_engine.protocol import (
    BadRequest,
    GenerateRequest,
    SamplingParams,
    parse_generate_request,
    parse_sampling_params,
)
from rl_core.inference.torch_engine.server import ENGINE_VERSION, build_app

__all__ = [
    "ENGINE_VERSION",
    "BadRequest",
    "EngineStopped",
    "GenerateRequest",
    "SamplingParams",
    "TorchEngine",
    "build_app",
    "load_model",
    "parse_generate_request",
    "parse_sampling_params",
]
