"""The inference client against a real torch engine: results, resume across a weight update, errors."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rl_core.inference import (
    GenerateResult,
    InferenceClient,
    InferenceError,
    InferenceUnavailable,
    parse_weight_version,
)
from rl_core.inference.launch import free_port

PROMPT = [72, 101, 108, 108, 111, 44, 32]


def test_client_and_package_import_neither_torch_nor_transformers():
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; import rl_core.inference; import rl_core.inference.client; "
        "bad = [m for m in ('torch', 'transformers', 'django') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_parse_weight_version():
    assert parse_weight_version("3") == 3
    assert parse_weight_version(4) == 4
    assert (
        parse_weight_version("default") == 0
    )  # SGLang without --weight-version: the initial policy
    assert parse_weight_version(None) == 0
    with pytest.raises(InferenceError, match="integer policy version"):
        parse_weight_version("v1.0")


async def test_generate_returns_ids_logprobs_and_versions(torch_engine, tiny_model_dir, reference):
    async with InferenceClient(torch_engine.url) as client:
        result = await client.generate(
            PROMPT, {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 3}
        )
    assert isinstance(result, GenerateResult)
    assert result.finish_reason == "length"
    assert result.completion_tokens == len(result.output_logprobs) == len(result.versions) == 10
    assert result.versions == [0] * 10
    assert result.prompt_tokens == len(PROMPT) and result.num_segments == 1
    expected = reference.logprobs(tiny_model_dir, PROMPT, result.output_ids)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=1e-4)
    assert result.to_dict()["output_ids"] == result.output_ids


async def test_generate_reports_stop_and_top_logprobs(torch_engine):
    async with InferenceClient(torch_engine.url) as client:
        greedy = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
        stop = greedy.output_ids[3]
        stopped = await client.generate(
            PROMPT,
            {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop]},
            top_logprobs_num=2,
        )
        # Sampled without a seed: ignore_eos, or an EOS drawn first ends it at one token.
        plain = await client.generate(
            PROMPT, {"max_new_tokens": 2, "ignore_eos": True}, return_logprob=False
        )
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop
    assert stopped.output_ids == greedy.output_ids[: greedy.output_ids.index(stop) + 1]
    assert stopped.top_logprobs is not None and len(stopped.top_logprobs) == len(stopped.output_ids)
    assert stopped.top_logprobs[0][0][1] == stopped.output_ids[0]
    assert plain.output_logprobs == [] and len(plain.versions) == 2


async def test_info_and_health(torch_engine, tiny_model_dir):
    async with InferenceClient(torch_engine.url) as client:
        assert await client.health() is True
        await client.wait_healthy(timeout=5)
        assert (await client.get_model_info())["model_path"] == str(tiny_model_dir)
        assert "internal_states" in await client.get_server_info()
        assert await client.get_weight_version() == 0
        assert await client.flush_cache() is True


async def test_bad_request_raises_with_status(torch_engine):
    async with InferenceClient(torch_engine.url) as client:
        with pytest.raises(InferenceError) as info:
            await client.generate(PROMPT, {"max_new_tokens": 4, "bogus": True})
    assert info.value.status == 400
    assert "bogus" in str(info.value)
    assert not isinstance(info.value, InferenceUnavailable)


async def test_unreachable_server_is_unavailable():
    async with InferenceClient(f"http://127.0.0.1:{free_port()}") as client:
        assert await client.health() is False
        with pytest.raises(InferenceUnavailable):
            await client.generate(PROMPT, {"max_new_tokens": 1})
        with pytest.raises(InferenceUnavailable):
            await client.wait_healthy(timeout=0.3, interval=0.1)


# --------------------------------------------------------------------------- resume across a weight update


@pytest.fixture(scope="module")
def updatable_engine(torch_engine_factory):
    return torch_engine_factory(weight_version=0)


async def _wait_generated(client: InferenceClient, at_least: int, start: int) -> None:
    deadline = time.monotonic() + 30
    while (await client.get_server_info())["internal_states"][0][
        "num_generated_tokens"
    ] < start + at_least:
        assert time.monotonic() < deadline, "the generation never started"
        await asyncio.sleep(0.02)


async def _tokens_so_far(client: InferenceClient) -> int:
    return (await client.get_server_info())["internal_states"][0]["num_generated_tokens"]


async def test_generation_interrupted_by_a_weight_update_resumes_with_per_token_versions(
    updatable_engine, tiny_model_dir, perturbed_model_dir, reference
):
    n = 60
    async with InferenceClient(updatable_engine.url) as client:
        await client.slow_down(0.03)
        try:
            start = await _tokens_so_far(client)
            task = asyncio.create_task(
                client.generate(PROMPT, {"max_new_tokens": n, "temperature": 0})
            )
            await _wait_generated(client, 5, start)
            # What the trainer does after a step: pause, load the new weights, continue.
            await client.pause_generation()
            await asyncio.sleep(0.3)  # the client has resubmitted by now; the server holds it
            assert not task.done()
            update = await client.update_weights_from_disk(
                str(perturbed_model_dir), weight_version=1
            )
            assert update["success"] is True
            await client.continue_generation()
            result = await asyncio.wait_for(task, 30)
            assert await client.get_weight_version() == 1
            # Leave the server as we found it.
            await client.update_weights_from_disk(str(tiny_model_dir), weight_version=0)
        finally:
            await client.slow_down(None)
            await client.continue_generation()

    k = result.versions.count(0)
    assert result.num_segments == 2
    assert 5 <= k < n
    assert result.versions == [0] * k + [1] * (n - k)
    assert result.finish_reason == "length" and len(result.output_ids) == n
    # Segment 1 is the old policy's greedy text, segment 2 the new policy's continuation of it.
    old, new = result.output_ids[:k], result.output_ids[k:]
    assert old == reference.greedy(tiny_model_dir, PROMPT, k)
    assert new == reference.greedy(perturbed_model_dir, PROMPT + old, n - k)
    # Each token's behaviour logprob comes from the weights that produced it.
    torch.testing.assert_close(
        torch.tensor(result.output_logprobs[:k]),
        reference.logprobs(tiny_model_dir, PROMPT, old),
        atol=1e-4,
        rtol=1e-4,
    )
    torch.testing.assert_close(
        torch.tensor(result.output_logprobs[k:]),
        reference.logprobs(perturbed_model_dir, PROMPT + old, new),
        atol=1e-4,
        rtol=1e-4,
    )


async def test_resumed_generation_keeps_its_budget_and_rid(updatable_engine):
    async with InferenceClient(updatable_engine.url) as client:
        await client.slow_down(0.03)
        try:
            start = await _tokens_so_far(client)
            task = asyncio.create_task(
                client.generate(
                    PROMPT, {"max_new_tokens": 40, "temperature": 0}, rid="steep-resume"
                )
            )
            await _wait_generated(client, 3, start)
            await client.pause_generation()
            await client.continue_generation()
            result = await asyncio.wait_for(task, 30)
        finally:
            await client.slow_down(None)
        reference_run = await client.generate(PROMPT, {"max_new_tokens": 40, "temperature": 0})
    assert result.rid == "steep-resume"
    assert result.num_segments == 2
    assert result.output_ids == reference_run.output_ids  # same weights: resuming changes nothing
    assert result.versions == [0] * 40


async def test_stream_yields_tokens_and_resumes_after_abort(updatable_engine):
    async with InferenceClient(updatable_engine.url) as client:
        await client.slow_down(0.03)
        chunks = []
        try:
            start = await _tokens_so_far(client)

            async def consume() -> None:
                async for chunk in client.generate_stream(
                    PROMPT, {"max_new_tokens": 30, "temperature": 0}
                ):
                    chunks.append(chunk)

            task = asyncio.create_task(consume())
            await _wait_generated(client, 4, start)
            await client.pause_generation()
            await client.continue_generation()
            await asyncio.wait_for(task, 30)
        finally:
            await client.slow_down(None)
        whole = await client.generate(PROMPT, {"max_new_tokens": 30, "temperature": 0})
    ids = [t for c in chunks for t in c.output_ids]
    assert ids == whole.output_ids
    assert [lp for c in chunks for lp in c.output_logprobs] == pytest.approx(
        whole.output_logprobs, abs=1e-4
    )
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length"
    assert len(chunks) > 2  # streamed, not one final blob


async def test_resume_budget_exhausted_reports_abort(updatable_engine):
    async with InferenceClient(updatable_engine.url, max_resumes=0) as client:
        await client.slow_down(0.03)
        try:
            start = await _tokens_so_far(client)
            task = asyncio.create_task(
                client.generate(PROMPT, {"max_new_tokens": 200, "ignore_eos": True})
            )
            await _wait_generated(client, 2, start)
            await client.abort_request(abort_all=True)
            result = await asyncio.wait_for(task, 10)
        finally:
            await client.slow_down(None)
    assert result.finish_reason == "abort"
    assert 0 < len(result.output_ids) < 200
