"""Steep against SGLang's own code, without a GPU: the launch command parsed by SGLang's own
server-argument parser, every ``/generate`` body through SGLang's JSON contract and its
``SamplingParams``, the torch engine's answers through SGLang's response schema, and the
control routes' bodies against the request classes SGLang's HTTP server takes.

SGLang (pinned as in the GPU image) is installed beside Steep's environment, without its
dependencies, in ``.venv/sglang-check`` (deploy/sglang-check.txt): its full dependency set
needs a CUDA torch. The judging runs in a subprocess with it on the path
(tests/rl_core/sglang_contract.py says which parts import on CPU, and why the rest is read
as source). CI sets ``STEEP_SGLANG_CHECK=required``: a missing install fails there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from rl_core.inference.client import InferenceClient, _Progress
from rl_core.inference.launch import LAUNCHERS
from rl_core.inference.protocol import parse_segment

ROOT = Path(__file__).resolve().parents[2]
CHECK_DIR = Path(os.environ.get("STEEP_SGLANG_CHECK_DIR", ROOT / ".venv" / "sglang-check"))
PINNED = next(
    line.split("==")[1].strip()
    for line in (ROOT / "deploy" / "sglang-check.txt").read_text().splitlines()
    if line.startswith("sglang==")
)
PROMPT = [72, 101, 108, 108, 111, 44, 32]

if not (CHECK_DIR / "sglang").is_dir():
    if os.environ.get("STEEP_SGLANG_CHECK") == "required":
        raise RuntimeError(f"SGLang's code is not installed in {CHECK_DIR}: ./steep install --dev")
    pytest.skip(
        f"SGLang's code is not installed in {CHECK_DIR} (./steep install --dev)",
        allow_module_level=True,
    )


def judge(artefacts: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(CHECK_DIR)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sglang_contract.py"))],
        input=json.dumps(artefacts),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


LAUNCHES = [
    ({}, {}),
    (
        {"lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"], "max_loras_per_batch": 4},
        {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]},
    ),
    ({"lora_rank": 16, "lora_target_modules": ["all-linear"], "max_loaded_loras": 12}, {}),
    (
        {
            "tensor_parallel": 2,
            "mem_fraction_static": 0.7,
            "max_running_requests": 64,
            "context_length": 4096,
            "dtype": "bfloat16",
            "base_gpu_id": 1,
            "served_model_name": "policy",
            "random_seed": 7,
            "log_level": "warning",
        },
        {"tp_size": 2, "mem_fraction_static": 0.7, "context_length": 4096, "dtype": "bfloat16"},
    ),
]


def gateway_params() -> list[dict]:
    """The sampling params the gateway sends for chat requests with every option it maps."""
    from webapp.gateway.chat_request import parse_chat_request
    from webapp.gateway.inference import _per_sample

    plain = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    full = parse_chat_request(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "stop": ["\n\n", "END"],
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "repetition_penalty": 1.1,
        }
    )
    params = [r.sampling_params(max_new_tokens=16, stop_token_ids=[2]) for r in (plain, full)]
    return params + _per_sample(params[1], 2, seed=11)


@pytest.fixture(scope="module")
def verdict(torch_engine: Any) -> dict[str, Any]:
    commands = []
    for options, _ in LAUNCHES:
        # The launcher make_inference_server("sglang", ...) picks on a GPU node.
        server = LAUNCHERS["sglang"](
            "/models/policy", host="0.0.0.0", port=30001, weight_version=5, **options
        )
        command = server.command()
        assert command[1:3] == ["-m", "sglang.launch_server"]
        commands.append(command[3:])

    rollout = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [2]}
    bodies = []
    for params in [rollout, *gateway_params()]:
        for stream, top_n, lora in [(False, 0, None), (True, 2, "run-v3")]:
            progress = _Progress.of(
                PROMPT, params, rid=None, return_logprob=True, top_n=top_n, lora_path=lora
            )
            bodies.append(progress.body(stream=stream))
    resumed = _Progress.of(PROMPT, {**rollout, "min_new_tokens": 4}, rid="r1", return_logprob=True, top_n=0)  # fmt: skip
    resumed.output_ids = [5, 6]
    bodies.append(resumed.body(stream=False))  # a resumed segment: prompt + what came before

    answers = []
    for body in bodies[:2] + bodies[2:4]:  # the torch engine's answers to the first bodies
        body = {k: v for k, v in body.items() if k != "lora_path"}
        with httpx.Client(timeout=60) as http:
            if body.get("stream"):
                with http.stream("POST", f"{torch_engine.url}/generate", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            answers.append(json.loads(line[6:]))
            else:
                answers.append(http.post(f"{torch_engine.url}/generate", json=body).json())

    return {
        "steep": {"commands": commands, "bodies": bodies, "answers": answers},
        "sglang": judge(
            {
                "commands": commands,
                "generate_bodies": bodies,
                "generate_answers": answers,
                "vocab_size": 300,
                "control_paths": list(CONTROL_CALLS),
            }
        ),
    }


def test_the_sglang_checked_is_the_gpu_images(verdict):
    dockerfile = (ROOT / "deploy" / "Dockerfile.gpu").read_text()
    assert f"ARG SGLANG_VERSION={PINNED}" in dockerfile
    assert verdict["sglang"]["version"] == PINNED


@pytest.mark.parametrize("index", range(len(LAUNCHES)))
def test_sglangs_own_parser_reads_the_launch_command_as_steep_means_it(verdict, index):
    parsed = verdict["sglang"]["commands"][index]
    assert parsed["unknown"] == []
    args = parsed["args"]
    assert (args["model_path"], args["host"], args["port"]) == ("/models/policy", "0.0.0.0", 30001)
    assert str(args["weight_version"]) == "5"
    for name, value in LAUNCHES[index][1].items():
        assert args[name] == value, name
    options = LAUNCHES[index][0]
    if options.get("lora_target_modules") == ["all-linear"]:
        assert args["lora_target_modules"] == ["all"] and args["max_loaded_loras"] == 12
    if "max_loras_per_batch" in options:
        assert args["max_loras_per_batch"] == 4


def test_every_generate_body_passes_sglangs_contract_and_sampling_params(verdict):
    judged = verdict["sglang"]["generate"]
    assert len(judged) == len(verdict["steep"]["bodies"]) >= 10
    for body, result in zip(verdict["steep"]["bodies"], judged, strict=True):
        assert result == {"contract": None, "sampling": None}, (body, result)


def test_sglangs_contract_refuses_a_misspelt_field(torch_engine):
    """The judge can fail: a body SGLang would refuse is reported so."""
    bad = {"input_ids": PROMPT, "sampling_params": {"max_new_tokenz": 4}}
    result = judge(
        {
            "commands": [],
            "generate_bodies": [bad],
            "generate_answers": [{"text": 1}],
            "vocab_size": 300,
            "control_paths": [],
        }
    )
    assert "max_new_tokenz" in result["generate"][0]["contract"]
    assert result["generate"][0]["sampling"] is not None
    assert result["answers"][0]["error"] is not None


def test_the_torch_engines_answers_fit_sglangs_response_schema_and_parse_the_same(verdict):
    answers = verdict["steep"]["answers"]
    judged = verdict["sglang"]["answers"]
    assert len(answers) >= 4
    for raw, result in zip(answers, judged, strict=True):
        assert result["error"] is None, (raw, result)
        canonical = result["canonical"]
        top_n = 2 if raw["meta_info"].get("output_top_logprobs") else 0
        # Steep reads SGLang's canonical form of the answer exactly as the engine's own.
        assert parse_segment(canonical, return_logprob=True, top_n=top_n) == parse_segment(
            raw, return_logprob=True, top_n=top_n
        )


async def _control_bodies() -> dict[str, dict]:
    sent: dict[str, dict] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        sent[request.url.path] = json.loads(request.content or b"{}")
        return httpx.Response(200, json={"success": True, "message": ""})

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    async with InferenceClient("http://sglang.test", http_client=http) as client:
        await client.pause_generation("abort")
        await client.continue_generation()
        await client.abort_request("rid-1")
        await client.update_weights_from_disk("/ckpt/v3", weight_version=3, flush_cache=True)
        await client.init_weights_update_group("10.0.0.1", 29500, 1, 3, backend="nccl")
        await client.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2, 2]], weight_version=4
        )
        await client.destroy_weights_update_group()
        await client.load_lora_adapter("run-v3", "/ckpt/run/v3")
        await client.unload_lora_adapter("run-v2")
    await http.aclose()
    return sent


CONTROL_CALLS = [
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/load_lora_adapter",
    "/unload_lora_adapter",
]


async def test_control_bodies_use_the_fields_of_the_classes_sglangs_server_takes(verdict):
    sent = await _control_bodies()
    assert sorted(sent) == sorted(CONTROL_CALLS)
    for path in CONTROL_CALLS:
        route = verdict["sglang"]["routes"][path]
        assert route["class"], f"SGLang's server has no {path} taking a request object"
        unknown = set(sent[path]) - set(route["fields"])
        assert not unknown, f"{path}: {sorted(unknown)} are not fields of {route['class']}"
