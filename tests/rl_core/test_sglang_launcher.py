"""Launchers: the SGLang command line, backend choice, and a real torch-engine process start/stop."""

from __future__ import annotations

import json
import os
import socket
import sys

import httpx
import pytest

from rl_core.config import INFERENCE_BACKENDS
from rl_core.inference import launch
from rl_core.inference.launch import (
    ServerStartError,
    TorchEngineServer,
    choose_backend,
    free_port,
    make_inference_server,
    sglang_available,
)
from rl_core.inference.sglang import SGLangServer
from rl_core.inference.vllm import VLLMServer


def test_sglang_command_line_uses_launch_server_flags(tmp_path):
    server = SGLangServer(
        "/models/qwen",
        host="0.0.0.0",
        port=30001,
        weight_version=3,
        tensor_parallel=2,
        mem_fraction_static=0.8,
        max_running_requests=64,
        context_length=8192,
        dtype="bfloat16",
        base_gpu_id=2,
        random_seed=11,
        extra_args=["--disable-radix-cache"],
        log_path=tmp_path / "sglang.log",
    )
    assert server.command() == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "/models/qwen",
        "--host", "0.0.0.0",
        "--port", "30001",
        "--weight-version", "3",
        "--tp-size", "2",
        "--mem-fraction-static", "0.8",
        "--max-running-requests", "64",
        "--context-length", "8192",
        "--dtype", "bfloat16",
        "--base-gpu-id", "2",
        "--random-seed", "11",
        "--disable-radix-cache",
    ]  # fmt: skip
    assert server.url == "http://127.0.0.1:30001"  # 0.0.0.0 is reached through loopback
    env = server.environment()
    # Logprobs after temperature (SGLang's default), like the torch engine and the trainer.
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
    assert env["RETURN_ORIGINAL_LOGPROB"] == "false"


def test_sglang_launcher_overrides_an_inherited_return_original_logprob(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    assert SGLangServer("/m", port=5).environment()["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"


def test_minimal_sglang_command_line_leaves_defaults_to_sglang():
    cmd = SGLangServer("/m", port=5).command()
    assert cmd[3:] == [
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "5",
        "--weight-version",
        "0",
        "--tp-size",
        "1",
    ]


def test_torch_engine_command_line(tiny_model_dir):
    server = TorchEngineServer(
        tiny_model_dir, port=1234, weight_version=2, num_threads=3, max_running_requests=8
    )
    cmd = server.command()
    assert cmd[:3] == [sys.executable, "-m", "rl_core.inference.torch_engine"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert flags == {
        "--model-path": str(tiny_model_dir),
        "--host": "127.0.0.1",
        "--port": "1234",
        "--weight-version": "2",
        "--max-running-requests": "8",
        "--dtype": "float32",
        "--device": "cpu",
        "--parent-pid": str(os.getpid()),  # it exits when the process that starts it is gone
        "--num-threads": "3",
    }


def test_auto_backend_picks_sglang_only_with_sglang_and_a_gpu(monkeypatch):
    monkeypatch.setattr(launch, "sglang_available", lambda: False)
    assert choose_backend("auto") == "torch"
    assert isinstance(make_inference_server("auto", "/m", port=1), TorchEngineServer)
    with pytest.raises(ValueError, match="sglang is not installed"):
        choose_backend("sglang")
    monkeypatch.setattr(launch, "sglang_available", lambda: True)
    assert choose_backend("auto") == "sglang"
    assert isinstance(make_inference_server("auto", "/m", port=1, tensor_parallel=2), SGLangServer)
    assert choose_backend("torch") == "torch"
    with pytest.raises(ValueError, match="not one of"):
        choose_backend("tgi")


def test_vllm_is_chosen_only_by_name_and_only_where_its_environment_is(monkeypatch):
    monkeypatch.setattr(launch, "sglang_available", lambda: False)
    monkeypatch.setattr(launch, "vllm_available", lambda: False)
    with pytest.raises(ValueError, match="./steep install --vllm"):
        choose_backend("vllm")
    monkeypatch.setattr(launch, "vllm_available", lambda: True)
    assert choose_backend("vllm") == "vllm"
    assert choose_backend("auto") == "torch"  # auto never picks it (docs/operations.md says why)
    server = make_inference_server("vllm", "/m", port=1, tensor_parallel=2, lora_rank=4)
    assert isinstance(server, VLLMServer)
    command = server.command()
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    # vLLM takes a few rank bounds only: the smallest that holds rank 4.
    assert command[command.index("--max-lora-rank") + 1] == "8"
    with pytest.raises(ValueError, match="one device"):
        make_inference_server("torch", "/m", port=1, tensor_parallel=2)


def test_torch_engine_server_starts_serves_and_stops(tiny_model_dir, tmp_path):
    server = make_inference_server(
        "torch", tiny_model_dir, port=free_port(), num_threads=1, log_path=tmp_path / "engine.log"
    )
    with server:
        assert server.is_running()
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        response = httpx.post(server.url + "/generate", json=body, timeout=30)
        assert response.status_code == 200 and len(response.json()["output_ids"]) == 2
    assert not server.is_running()
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", server.port))
    server.stop()  # idempotent


def test_server_that_cannot_start_raises_with_its_log(tmp_path):
    server = TorchEngineServer(
        tmp_path / "no-such-model", num_threads=1, log_path=tmp_path / "bad.log"
    )
    server.start()
    with pytest.raises(ServerStartError, match="exited with code") as info:
        server.wait_healthy(timeout=120)
    assert "no-such-model" in str(info.value)
    server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not sglang_available(), reason="needs sglang and a CUDA GPU")
def test_sglang_server_generates_with_logprobs_and_version(tiny_model_dir, tmp_path):
    server = SGLangServer(
        tiny_model_dir,
        port=free_port(),
        weight_version=5,
        mem_fraction_static=0.3,
        log_path=tmp_path / "sglang.log",
    )
    with server:
        body = {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True,
        }
        data = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    assert len(data["output_ids"]) == 4
    assert [t[1] for t in data["meta_info"]["output_token_logprobs"]] == data["output_ids"]
    assert data["meta_info"]["weight_version"] == "5"


def test_every_configurable_backend_but_auto_has_a_launcher():
    assert set(INFERENCE_BACKENDS) == {"auto", *launch.LAUNCHERS}
    for name, launcher in launch.LAUNCHERS.items():
        assert launcher.backend == name


def test_every_engine_keeps_its_prefix_cache_on(tiny_model_dir):
    """Issue 36: a session's next turn reuses the last one's KV in every engine: SGLang's radix
    cache and the torch engine's are never turned off, vLLM's prefix caching is asked for."""
    sglang = SGLangServer("/models/x", tensor_parallel=1).command()
    torch_engine = TorchEngineServer(tiny_model_dir).command()
    assert "--disable-radix-cache" not in sglang and "--disable-radix-cache" not in torch_engine
    assert "--enable-prefix-caching" in VLLMServer("/models/x").command()
    assert "--enable-prefix-caching" not in VLLMServer("/models/x", prefix_caching=False).command()


def test_vllm_on_cpus_never_splits_a_prefill(tiny_model_dir):
    """vLLM's CPU build ends its engine when a seeded request's split prefill discards a
    sampled token (it rewinds the request's generator, and a CPU generator has no offset): the
    CPU settings turn chunked prefill off, with a step budget that holds the longest prompt."""
    from rl_core.inference.vllm import vllm_cpu_settings

    settings = {k: v for k, v in vllm_cpu_settings().items() if k != "env"}
    cmd = VLLMServer(tiny_model_dir, **settings).command()
    assert "--no-enable-chunked-prefill" in cmd
    context = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    budget = int(cmd[cmd.index("--max-num-batched-tokens") + 1])
    assert budget == max(context, 2048)
    cmd = VLLMServer(tiny_model_dir, max_model_len=9000, **settings).command()
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "9000"
    default = VLLMServer(tiny_model_dir).command()  # a GPU: vLLM's own chunked prefill
    assert "--no-enable-chunked-prefill" not in default
    assert "--max-num-batched-tokens" not in default
