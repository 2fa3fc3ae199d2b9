"""vLLM (0.32 and later) as an inference backend: its launcher and its client.

Steep speaks SGLang's protocol everywhere above the client (``rl_core.inference.client``);
``VLLMClient`` is that client with vLLM's wire underneath, so the resume loop, the per-token
versions and the weight sync above it run unchanged:

- generation: token-in/token-out ``POST /inference/v1/generate`` (``--enable-scale-out``):
  ``token_ids`` and vLLM's ``sampling_params`` out, ``choices[0].token_ids``, ``logprobs`` and
  ``weight_versions`` spans back, translated to SGLang's answer (``output_ids``,
  ``meta_info.output_token_logprobs``, ``finish_reason.type``, ``weight_versions``); a stream's
  events carry only what is new, and are accumulated into SGLang's cumulative events;
- abort by request id: ``POST /inference/v1/abort_requests``;
- pause and resume: ``POST /pause?mode=abort|keep|wait`` and ``/resume`` (the RL routes,
  which need ``VLLM_SERVER_DEV_MODE=1``);
- weights from disk without a restart: ``POST /collective_rpc`` ``reload_weights`` with
  ``weights_path`` (the workers reload in place), then ``/update_weight_version``;
- the weight version: ``GET /weight_info``.

Logprobs are of the distribution actually sampled: ``--logprobs-mode processed_logprobs``
(after temperature and the top-p/top-k truncation), what SGLang reports and the trainer
recomputes. vLLM runs from an environment of its own (``STEEP_VLLM_PYTHON``, default
``.venv-vllm`` beside Steep's, made by ``./steep install --vllm``): it pins transformers and
fastapi ranges of its own. This module imports neither torch nor vllm.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import httpx

from rl_core.inference.client import InferenceClient, PooledInferenceClient
from rl_core.inference.process import InferenceServer
from rl_core.inference.protocol import parse_weight_version
from rl_core.inference.updates import group_fields

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# Where vLLM finds Steep's weight-transfer engine: its entry point (a dist-info directory
# on the server's path) and the module it names (rl_core.inference.vllm_transfer).
PLUGIN_PATH = ROOT / "deploy" / "vllm-plugin"
TRANSFER_BACKEND = "steep"
# vLLM's own default step budget (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS).
MIN_BATCHED_TOKENS = 2048
# What the RL routes and runtime LoRA loading need; logprobs of the sampled distribution.
VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


# The ranks vLLM's --max-lora-rank takes (vllm.config.lora.MaxLoRARanks); adapters of any
# rank up to it load.
LORA_RANK_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_bound(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that admits adapters of ``rank``."""
    for bound in LORA_RANK_BOUNDS:
        if rank <= bound:
            return bound
    raise ValueError(f"vLLM serves LoRA ranks up to {LORA_RANK_BOUNDS[-1]}; this run asks {rank}")


def context_length(model_path: str | os.PathLike[str]) -> int | None:
    """The model's context length from its ``config.json`` (None when it does not say)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def vllm_python() -> str:
    """The interpreter of vLLM's environment (``STEEP_VLLM_PYTHON``, else ``.venv-vllm``)."""
    return os.environ.get("STEEP_VLLM_PYTHON") or str(DEFAULT_PYTHON)


def vllm_available() -> bool:
    return Path(vllm_python()).exists()


def vllm_cpu_settings() -> dict[str, Any]:
    """How Steep runs vLLM's CPU build: float32, as the trainer computes on CPUs (so the
    logprobs recorded and recomputed agree; ``STEEP_VLLM_CPU_DTYPE=bfloat16`` serves in bf16,
    to measure the mismatch that makes: docs/benchmarks/long-sessions.md), a KV cache of
    ``STEEP_VLLM_CPU_KVCACHE_GB`` GiB (default 2; vLLM's own default takes most of the host's
    memory), and ``STEEP_TORCH_THREADS`` threads (default 1), as the torch engine.

    Prefills are never split across steps (``--no-enable-chunked-prefill``): vLLM rewinds the
    random generator of a seeded request whose split prefill sampled a token it then discards,
    and a CPU generator cannot rewind (``RuntimeError: CPU Generator does not use offset``,
    which ends the engine); Steep seeds every dataset-mode sample (``member_seed``)."""
    threads = os.environ.get("STEEP_TORCH_THREADS", "1")
    return {
        "dtype": os.environ.get("STEEP_VLLM_CPU_DTYPE", "float32"),
        "kv_cache_space_gb": int(os.environ.get("STEEP_VLLM_CPU_KVCACHE_GB", "2")),
        "chunked_prefill": False,
        "env": {"OMP_NUM_THREADS": threads},
    }


class VLLMServer(InferenceServer):
    """``python -m vllm.entrypoints.openai.api_server`` from vLLM's own environment."""

    backend = "vllm"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        tensor_parallel: int = 1,
        dtype: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float | None = None,
        served_model_name: str | None = None,
        seed: int | None = None,
        lora_rank: int = 0,
        lora_target_modules: Sequence[str] = (),
        max_loras_per_batch: int | None = None,
        max_loaded_loras: int | None = None,
        kv_cache_space_gb: int | None = None,
        prefix_caching: bool = True,
        chunked_prefill: bool | None = None,
        **kwargs: Any,
    ):
        super().__init__(model_path, **kwargs)
        self.tensor_parallel = tensor_parallel
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.gpu_memory_utilization = gpu_memory_utilization
        self.served_model_name = served_model_name
        self.seed = seed
        # vLLM reads each adapter's target modules from its adapter_config.json: the launch
        # takes the rank bound and how many adapters a batch (--max-loras) and the CPU-side
        # cache (--max-cpu-loras) hold; ``lora_target_modules`` is accepted for the common
        # launcher interface and needs no flag.
        self.lora_rank = lora_rank
        self.max_loras = max_loras_per_batch
        self.max_cpu_loras = max_loaded_loras
        self.kv_cache_space_gb = kv_cache_space_gb
        self.prefix_caching = prefix_caching  # False: vLLM's own default
        self.chunked_prefill = chunked_prefill  # None: vLLM's own default (on)

    def command(self) -> list[str]:
        cmd = [
            vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--enable-scale-out",  # the token-in/token-out /inference/v1/generate
            "--logprobs-mode", "processed_logprobs",
            "--tensor-parallel-size", str(self.tensor_parallel),
            "--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND}),
        ]  # fmt: skip
        optional = {
            "--dtype": self.dtype,
            "--max-model-len": self.max_model_len,
            "--max-num-seqs": self.max_num_seqs,
            "--gpu-memory-utilization": self.gpu_memory_utilization,
            "--served-model-name": self.served_model_name,
            "--seed": self.seed,
        }
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        if self.prefix_caching:
            # A session's next turn reuses the last one's KV blocks (issue 36's long sessions);
            # vLLM's default for text models, asked for so a change of default does not drop it.
            cmd.append("--enable-prefix-caching")
        if self.chunked_prefill is False:
            # A whole prompt must then fit one step's token budget.
            cmd.append("--no-enable-chunked-prefill")
            length = self.max_model_len or context_length(self.model_path)
            if length:
                cmd += ["--max-num-batched-tokens", str(max(length, MIN_BATCHED_TOKENS))]
        if self.lora_rank > 0:
            cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank_bound(self.lora_rank))]
            if self.max_loras is not None:
                cmd += ["--max-loras", str(self.max_loras)]
            if self.max_cpu_loras is not None:
                cmd += ["--max-cpu-loras", str(max(self.max_cpu_loras, self.max_loras or 1))]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {**super().environment(), **VLLM_ENV}
        paths = (str(ROOT), str(PLUGIN_PATH), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        if self.kv_cache_space_gb is not None:  # the CPU build's KV cache, in GiB
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gb)
        return env


def vllm_sampling_params(params: dict[str, Any], *, top_n: int, logprobs: bool) -> dict[str, Any]:
    """SGLang's ``sampling_params`` names as vLLM's ``SamplingParams``."""
    out: dict[str, Any] = {"max_tokens": int(params.get("max_new_tokens", 128))}
    named_alike = (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )
    for name in named_alike:
        if params.get(name) is not None:
            out[name] = params[name]
    if params.get("top_k") is not None and int(params["top_k"]) > 0:
        out["top_k"] = int(params["top_k"])
    if params.get("stop"):
        out["stop"] = params["stop"]
    if params.get("stop_token_ids"):
        out["stop_token_ids"] = [int(t) for t in params["stop_token_ids"]]
    if params.get("ignore_eos"):
        out["ignore_eos"] = True
    if params.get("min_new_tokens"):
        out["min_tokens"] = int(params["min_new_tokens"])
    if params.get("sampling_seed") is not None:
        out["seed"] = int(params["sampling_seed"])
    if logprobs:
        out["logprobs"] = int(top_n)  # 0: the sampled token's own logprob only
    out["skip_special_tokens"] = False
    return out


def vllm_generate_body(body: dict[str, Any]) -> dict[str, Any]:
    """A Steep (SGLang) ``/generate`` body as vLLM's ``/inference/v1/generate`` request."""
    request: dict[str, Any] = {
        "request_id": body["rid"],
        "token_ids": list(body["input_ids"]),
        "sampling_params": vllm_sampling_params(
            body.get("sampling_params") or {},
            top_n=int(body.get("top_logprobs_num") or 0),
            logprobs=bool(body.get("return_logprob", True)),
        ),
        "stream": bool(body.get("stream")),
    }
    if body.get("lora_path"):
        request["model"] = body["lora_path"]  # a loaded adapter is named as a model
    return request


_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "cancelled": "abort"}


class _Answer:
    """One vLLM request's answer so far, in SGLang's cumulative shape.

    ``provisional``: the version given to the tokens of a stream's events before its last,
    which alone reports the spans (the client's newest known version); the last event's
    spans then revise them (``GenerateChunk.revised_versions``)."""

    def __init__(self, top_n: int, provisional: int = 0):
        self.top_n = top_n
        self.provisional = provisional
        self.ids: list[int] = []
        self.logprobs: list[list] = []
        self.top: list[list[list]] = []
        self.spans: list[dict[str, Any]] = []
        self.finish: dict[str, Any] | None = None

    def add(self, data: dict[str, Any]) -> dict[str, Any]:
        choice = (data.get("choices") or [{}])[0]
        new_ids = [int(t) for t in choice.get("token_ids") or []]
        self.ids += new_ids
        for entry in ((choice.get("logprobs") or {}).get("content")) or []:
            self.logprobs.append([float(entry["logprob"]), int(entry["token_id"]), None])
            if self.top_n:  # vLLM lists the sampled token among them; SGLang, the best first
                best = sorted(entry.get("top_logprobs") or [], key=lambda t: -t["logprob"])
                self.top.append(
                    [[float(t["logprob"]), int(t["token_id"]), None] for t in best][: self.top_n]
                )
        if choice.get("weight_versions"):
            # Spans over the whole output so far (a stream reports them on its last event).
            self.spans = [dict(span) for span in choice["weight_versions"]]
        reason = choice.get("finish_reason")
        if reason:
            self.finish = {"type": _FINISH.get(reason, reason)}
            if choice.get("stop_reason") is not None:
                self.finish["matched"] = choice["stop_reason"]
        return self.sglang()

    def sglang(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "output_token_logprobs": self.logprobs,
            "finish_reason": self.finish,
            "weight_versions": self.spans,
            "completion_tokens": len(self.ids),
        }
        meta["weight_version"] = self.spans[-1]["version"] if self.spans else self.provisional
        if self.top_n:
            meta["output_top_logprobs"] = self.top
        return {"text": "", "output_ids": list(self.ids), "meta_info": meta}


class VLLMClient(InferenceClient):
    """``InferenceClient`` for a vLLM server: SGLang's interface, vLLM's routes."""

    backend = "vllm"
    last_version = 0  # the newest weight version an answer reported

    def _answer(self, body: dict[str, Any]) -> _Answer:
        return _Answer(int(body.get("top_logprobs_num") or 0), self.last_version)

    def _seen(self, answer: dict[str, Any]) -> dict[str, Any]:
        spans = answer["meta_info"]["weight_versions"]
        if spans:
            self.last_version = max(self.last_version, parse_weight_version(spans[-1]["version"]))
        return answer

    async def _post_generate(self, body: dict[str, Any]) -> Any:
        request = vllm_generate_body(body)
        response = await self._request("POST", "/inference/v1/generate", json_body=request)
        return self._seen(self._answer(body).add(response.json()))

    async def _segment_events(
        self, body: dict[str, Any], *, stream: bool
    ) -> AsyncGenerator[Any, None]:
        if not stream:
            yield await self._post_generate(body)
            return
        answer = self._answer(body)
        events = self._stream_events("/inference/v1/generate", vllm_generate_body(body))
        async with contextlib.aclosing(events):  # closing the stream early ends the request
            async for data in events:
                yield self._seen(answer.add(data))

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """``abort`` ends every request in flight (they return aborted and are resumed);
        ``keep`` (SGLang's ``in_place``) freezes them until ``continue_generation``."""
        vllm_mode = {"in_place": "keep", "retract": "keep"}.get(mode, mode)
        response = await self._request(
            "POST", f"/pause?mode={vllm_mode}", timeout=self._control_timeout
        )
        return response.json()

    async def continue_generation(self) -> dict[str, Any]:
        return (await self._request("POST", "/resume", timeout=self._control_timeout)).json()

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused")).json().get("is_paused"))

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        # The server names a token-in/token-out request "generate-tokens-<request_id>".
        body = {"request_ids": [] if abort_all or rid is None else [f"generate-tokens-{rid}"]}
        await self._request(
            "POST", "/inference/v1/abort_requests", json_body=body, timeout=self._control_timeout
        )

    async def get_weight_version(self) -> int:
        info = (await self._request("GET", "/weight_info")).json()
        return parse_weight_version(info.get("weight_version"))

    async def get_server_info(self) -> dict[str, Any]:
        """What ``WeightSync`` reads of a server (SGLang's names): ``version``, ``device``,
        ``tp_size``; ``weight_broadcast``: whether it runs Steep's weight-transfer engine
        (``rl_core.inference.vllm_transfer``), so that it can join a weight group."""
        info = (await self._request("GET", "/server_info?config_format=json")).json()
        config = info.get("vllm_config") or {}
        device = str((config.get("device_config") or {}).get("device") or "cpu")
        parallel = config.get("parallel_config") or {}
        transfer = config.get("weight_transfer_config") or {}
        return {
            "version": f"vllm-{(await self._request('GET', '/version')).json().get('version')}",
            "device": device,
            "tp_size": int(parallel.get("tensor_parallel_size") or 1),
            "weight_broadcast": transfer.get("backend") == TRANSFER_BACKEND,
        }

    async def get_model_info(self) -> dict[str, Any]:
        return {"weight_version": str(await self.get_weight_version())}

    # Steep's weight group through vLLM's weight-transfer routes (its "steep" engine takes
    # SGLang's fields): init once; per update start, update (pending while the trainer
    # broadcasts), finish with the version; shut down to leave.

    async def init_weights_update_group(  # type: ignore[override]
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        init = group_fields(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s
        )
        await self._request(
            "POST",
            "/init_weight_transfer_engine",
            json_body={"init_info": init},
            timeout=self._control_timeout,
        )
        return {"success": True, "message": "joined"}

    async def update_weights_from_distributed(  # type: ignore[override]
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Receive ``names`` by broadcast from rank 0, then serve them as ``weight_version``.
        Pause the server around it (``in_place``) for a clean cut, as for SGLang."""
        if abort_all_requests:
            await self.abort_request(abort_all=True)
        limit = self._control_timeout if timeout is None else httpx.Timeout(timeout)
        update = {
            "names": list(names),
            "dtype_names": list(dtypes),
            "shapes": [list(s) for s in shapes],
        }
        await self._request("POST", "/start_weight_update", timeout=limit)
        try:
            await self._request(
                "POST", "/update_weights", json_body={"update_info": update}, timeout=limit
            )
        finally:  # a half-received update still ends its reload session
            version = None if weight_version is None else str(weight_version)
            await self._request(
                "POST",
                "/finish_weight_update",
                json_body={"weight_version": version},
                timeout=limit,
            )
        if flush_cache:
            await self.flush_cache()
        return {"success": True, "message": f"received {len(names)} tensors"}

    async def destroy_weights_update_group(  # type: ignore[override]
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        await self._request(
            "POST", "/shutdown_weight_transfer_engine", timeout=self._control_timeout
        )
        return {"success": True}

    async def update_weight_version(self, version: int | str) -> None:
        await self._request(
            "POST",
            "/update_weight_version",
            json_body={"new_version": str(version)},
            timeout=self._control_timeout,
        )

    async def update_weights_from_disk(  # type: ignore[override]
        self,
        model_path: str,
        *,
        weight_version: int | str | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        flush_cache: bool | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Reload the workers' weights in place from ``model_path`` (safetensors in HF layout),
        then tag what follows with ``weight_version``. Requests keep running through it
        unless ``abort_all_requests``; pause the server around it for a clean cut."""
        if abort_all_requests:
            await self.abort_request(abort_all=True)
        limit = self._control_timeout if timeout is None else httpx.Timeout(timeout)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(model_path)}}
        await self._request("POST", "/collective_rpc", json_body=rpc, timeout=limit)
        if weight_version is not None:
            await self.update_weight_version(weight_version)
        if flush_cache is not False:
            await self.flush_cache()
        return {"success": True, "message": f"reloaded {model_path}"}

    async def flush_cache(self) -> bool:
        """Drop the prefix cache (KV of the old weights); False when vLLM refused because
        requests hold blocks (in a pause in place: those requests keep their KV, as SGLang's
        in_place pause keeps its cache)."""
        answer = await self._request("POST", "/reset_prefix_cache", timeout=self._control_timeout)
        return bool(answer.json().get("success"))

    async def load_lora_adapter(  # type: ignore[override]
        self, lora_name: str, lora_path: str, *, pinned: bool = False
    ) -> dict[str, Any]:
        body = {"lora_name": lora_name, "lora_path": lora_path}
        await self._request(
            "POST", "/v1/load_lora_adapter", json_body=body, timeout=self._control_timeout
        )
        return {"success": True, "loaded_adapters": [lora_name]}

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        await self._request(
            "POST",
            "/v1/unload_lora_adapter",
            json_body={"lora_name": lora_name},
            timeout=self._control_timeout,
        )
        return {"success": True}


def client_for(
    backend: str, base_url: str, *, pooled: bool = False, **kwargs: Any
) -> InferenceClient:
    """The client that speaks ``backend``'s protocol: vLLM's, or SGLang's for the others (the
    torch engine, SGLang, an attached ``external`` server). ``pooled``: the gateway's
    ``PooledInferenceClient`` for SGLang's protocol (vLLM's client has one kind)."""
    if backend == "vllm":
        return VLLMClient(base_url, **kwargs)
    return (PooledInferenceClient if pooled else InferenceClient)(base_url, **kwargs)


__all__: Sequence[str] = [
    "VLLMClient",
    "VLLMServer",
    "client_for",
    "vllm_available",
    "vllm_cpu_settings",
    "vllm_generate_body",
    "vllm_python",
    "vllm_sampling_params",
]
