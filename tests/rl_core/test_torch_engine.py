"""The torch engine over real HTTP on 127.0.0.1: SGLang's native protocol, batching, pause, weight updates."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, " (token id == byte)


async def post(url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(url + path, json=body, **kwargs)


async def get(url: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.get(url + path)


async def generate(url: str, input_ids: list[int], **sampling: Any) -> dict[str, Any]:
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
    response = await post(url, "/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


async def stats(url: str) -> dict[str, Any]:
    return (await get(url, "/server_info")).json()["internal_states"][0]


async def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- /generate


async def test_generate_returns_sglang_fields_and_logprobs_of_the_tempered_logits(
    torch_engine, tiny_model_dir, reference
):
    data = await generate(
        torch_engine.url, PROMPT, max_new_tokens=12, temperature=0.8, top_p=0.9, sampling_seed=7
    )
    meta = data["meta_info"]
    assert set(data) >= {"text", "output_ids", "meta_info"}
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == 12 == len(data["output_ids"])
    assert meta["weight_version"] == "0"
    assert isinstance(meta["id"], str) and meta["id"]
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == data["output_ids"]
    assert all(t[2] is None for t in triples)  # text only with return_text_in_logprobs
    # log_softmax(logits / 0.8), before top-p: as SGLang reports it (rl_core.sampling).
    expected = reference.logprobs(tiny_model_dir, PROMPT, data["output_ids"], temperature=0.8)
    torch.testing.assert_close(
        torch.tensor([t[0] for t in triples]), expected, atol=1e-4, rtol=1e-4
    )


async def test_sampling_seed_makes_sampling_reproducible(torch_engine):
    a = await generate(torch_engine.url, PROMPT, max_new_tokens=16, sampling_seed=1)
    b = await generate(torch_engine.url, PROMPT, max_new_tokens=16, sampling_seed=1)
    c = await generate(torch_engine.url, PROMPT, max_new_tokens=16, sampling_seed=2)
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


async def test_greedy_matches_a_plain_forward_loop(torch_engine, tiny_model_dir, reference):
    data = await generate(torch_engine.url, PROMPT, max_new_tokens=20, temperature=0)
    assert data["output_ids"] == reference.greedy(tiny_model_dir, PROMPT, 20)


async def test_stop_token_ids_end_generation_with_a_stop_reason(torch_engine):
    greedy = (await generate(torch_engine.url, PROMPT, max_new_tokens=12, temperature=0))[
        "output_ids"
    ]
    stop = greedy[5]
    first = greedy.index(stop)
    data = await generate(
        torch_engine.url, PROMPT, max_new_tokens=12, temperature=0, stop_token_ids=[stop]
    )
    assert (
        data["output_ids"] == greedy[: first + 1]
    )  # the stop token is returned (and has a logprob)
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(data["meta_info"]["output_token_logprobs"]) == first + 1
    ignored = await generate(
        torch_engine.url,
        PROMPT,
        max_new_tokens=12,
        temperature=0,
        stop_token_ids=[stop],
        ignore_eos=True,
    )
    assert ignored["output_ids"] == greedy  # ignore_eos disables stop tokens, as in SGLang


async def test_stop_strings_end_generation_and_are_trimmed_from_text(torch_engine):
    for first_byte in range(97, 123):  # find a prompt whose greedy output has a plain ASCII letter
        prompt = [first_byte, *PROMPT]
        greedy = (await generate(torch_engine.url, prompt, max_new_tokens=16, temperature=0))[
            "output_ids"
        ]
        letters = [i for i, t in enumerate(greedy) if 97 <= t <= 122 and i > 0]
        if letters:
            break
    else:
        pytest.skip("no ASCII letter in any greedy output")
    stop = chr(greedy[letters[0]])
    data = await generate(torch_engine.url, prompt, max_new_tokens=16, temperature=0, stop=[stop])
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert data["output_ids"] == greedy[: letters[0] + 1]
    assert stop not in data["text"]


async def test_text_input_is_tokenized_like_input_ids(torch_engine):
    by_text = await post(
        torch_engine.url,
        "/generate",
        {"text": "Hello, ", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    )
    by_ids = await generate(torch_engine.url, PROMPT, max_new_tokens=8, temperature=0)
    assert by_text.json()["output_ids"] == by_ids["output_ids"]
    assert by_text.json()["meta_info"]["prompt_tokens"] == len(PROMPT)


async def test_top_logprobs_and_input_logprobs(torch_engine, tiny_model_dir, reference):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    meta = (await post(torch_engine.url, "/generate", body)).json()["meta_info"]
    for (lp, token, text), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        assert len(top) == 3
        assert top[0][1] == token and top[0][0] == pytest.approx(lp)  # greedy picks the best
        assert top[0][0] >= top[1][0] >= top[2][0]
        assert isinstance(text, str)
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == PROMPT
    assert inputs[0][0] is None  # nothing predicts the first token
    expected = reference.logprobs(tiny_model_dir, PROMPT[:1], PROMPT[1:])
    torch.testing.assert_close(
        torch.tensor([t[0] for t in inputs[1:]]), expected, atol=1e-4, rtol=1e-4
    )


async def test_stream_sends_cumulative_events_and_done(torch_engine):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_logprob": True,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", torch_engine.url + "/generate", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    import json

    events = [json.loads(line[5:]) for line in lines[:-1]]
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * 5
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    plain = await generate(torch_engine.url, PROMPT, max_new_tokens=6, temperature=0)
    assert events[-1]["output_ids"] == plain["output_ids"]


async def test_concurrent_requests_are_batched_and_greedy_equals_unbatched(torch_engine):
    prompts = [[40 + i] * (3 + 2 * i) + PROMPT for i in range(8)]  # different lengths: left padding
    lengths = [24 - i for i in range(8)]  # rows finish at different steps
    single = [
        await generate(torch_engine.url, p, max_new_tokens=n, temperature=0)
        for p, n in zip(prompts, lengths, strict=True)
    ]
    before = await stats(torch_engine.url)
    batched = await asyncio.gather(
        *(
            generate(torch_engine.url, p, max_new_tokens=n, temperature=0)
            for p, n in zip(prompts, lengths, strict=True)
        )
    )
    after = await stats(torch_engine.url)
    decode_steps = after["num_decode_steps"] - before["num_decode_steps"]
    # Unbatched, every token after the first needs its own decode step.
    assert decode_steps < sum(n - 1 for n in lengths)
    assert after["max_batch_size_seen"] > 1
    assert after["busy_seconds"] > before["busy_seconds"]  # utilisation counter advances with work
    for s, b in zip(single, batched, strict=True):
        assert b["output_ids"] == s["output_ids"]
        torch.testing.assert_close(
            torch.tensor([t[0] for t in b["meta_info"]["output_token_logprobs"]]),
            torch.tensor([t[0] for t in s["meta_info"]["output_token_logprobs"]]),
            atol=1e-5,
            rtol=1e-5,
        )


async def test_max_new_tokens_zero_and_context_limit(torch_engine_factory, tiny_model_dir):
    server = torch_engine_factory(context_length=16)
    data = await generate(server.url, PROMPT, max_new_tokens=0)
    assert data["output_ids"] == [] and data["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }
    capped = await generate(server.url, PROMPT, max_new_tokens=100, temperature=0)
    assert len(capped["output_ids"]) == 16 - len(PROMPT)
    assert capped["meta_info"]["finish_reason"]["type"] == "length"
    too_long = await post(
        server.url, "/generate", {"input_ids": list(range(16)), "sampling_params": {}}
    )
    assert too_long.status_code == 400
    server.stop()


# --------------------------------------------------------------------------- errors and info


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"sampling_params": {}}, "input_ids or text"),
        ({"input_ids": [1], "text": "a"}, "input_ids or text"),
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [[1, 2], [3]]}, "Batched"),
        ({"input_ids": [1, "2"]}, "integer"),
        ({"input_ids": [1, 100000]}, "vocabulary"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {"1": 5}}}, "not supported"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "Unknown sampling parameter"),
        ({"input_ids": [1], "sampling_params": "fast"}, "JSON object"),
        ({"input_ids": [1], "return_logprob": "yes"}, "true or false"),
        ([1, 2, 3], "JSON object"),
    ],
)
async def test_bad_generate_requests_are_400_json(torch_engine, body, fragment):
    response = await post(torch_engine.url, "/generate", body)
    assert response.status_code == 400
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400
    assert fragment in error["message"]


async def test_malformed_json_and_bad_control_requests_are_400(torch_engine):
    response = await post(
        torch_engine.url,
        "/generate",
        None,
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["message"]
    response = await post(torch_engine.url, "/pause_generation", {"mode": "in_place"})
    assert response.status_code == 400 and "not supported" in response.json()["message"]
    response = await post(torch_engine.url, "/update_weights_from_disk", {})
    assert response.status_code == 400 and "model_path" in response.json()["message"]
    response = await post(
        torch_engine.url, "/update_weights_from_disk", {"model_path": "/nonexistent/steep-model"}
    )
    assert response.status_code == 400 and response.json()["success"] is False
    response = await post(torch_engine.url, "/abort_request", {})
    assert response.status_code == 400
    response = await get(torch_engine.url, "/no_such_endpoint")
    assert response.status_code == 404 and response.json()["code"] == 404
    assert (await get(torch_engine.url, "/health")).status_code == 200  # still serving


async def test_info_endpoints_report_model_and_version(torch_engine, tiny_model_dir):
    assert (await get(torch_engine.url, "/health")).status_code == 200
    assert (await get(torch_engine.url, "/health_generate")).status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = (await get(torch_engine.url, path)).json()
        assert info["model_path"] == str(tiny_model_dir)
        assert info["weight_version"] == "0"
        assert info["is_generation"] is True
        assert info["architectures"] == ["LlamaForCausalLM"]
    assert (await get(torch_engine.url, "/get_weight_version")).json() == {"weight_version": "0"}
    server_info = (await get(torch_engine.url, "/get_server_info")).json()
    assert server_info["max_running_requests"] == 32
    assert "max_batch_size_seen" in server_info["internal_states"][0]
    models = (await get(torch_engine.url, "/v1/models")).json()
    assert models["data"][0]["id"] == str(tiny_model_dir)
    assert (await post(torch_engine.url, "/flush_cache", None)).status_code == 200


# --------------------------------------------------------------------------- pause, abort, weight updates


@pytest.fixture(scope="module")
def private_engine(torch_engine_factory):
    """A server this module may pause, slow down and update."""
    return torch_engine_factory(weight_version=0)


@pytest.fixture
async def slow_engine(private_engine):
    await post(private_engine.url, "/slow_down", {"forward_sleep_time": 0.03})
    yield private_engine
    await post(private_engine.url, "/slow_down", {"forward_sleep_time": None})
    await post(private_engine.url, "/continue_generation", {})


async def _generated_tokens(url: str) -> int:
    return (await stats(url))["num_generated_tokens"]


async def test_pause_aborts_in_flight_requests_and_holds_new_ones_until_continue(slow_engine):
    url = slow_engine.url
    start = await _generated_tokens(url)
    # The module's engine: the update tests before this one (in whatever order) move its version.
    version = (await get(url, "/get_weight_version")).json()["weight_version"]
    running = asyncio.create_task(generate(url, PROMPT, max_new_tokens=300, temperature=0))

    async def progressed() -> bool:
        return await _generated_tokens(url) >= start + 5

    await wait_for(progressed)
    response = await post(url, "/pause_generation", {"mode": "abort"})
    assert response.json() == {"message": "Generation paused successfully.", "status": "ok"}
    aborted = await asyncio.wait_for(running, 10)
    meta = aborted["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 5 <= len(aborted["output_ids"]) < 300  # the tokens generated so far come back
    assert len(meta["output_token_logprobs"]) == len(aborted["output_ids"])
    assert meta["weight_version"] == version

    held = asyncio.create_task(generate(url, PROMPT, max_new_tokens=3, temperature=0))

    async def arrived() -> bool:  # however long the request takes to get there
        return (await stats(url))["num_waiting_reqs"] == 1

    await wait_for(arrived)
    assert not held.done()  # paused: new requests wait, like SGLang's pause condition
    await post(url, "/continue_generation", {})
    done = await asyncio.wait_for(held, 10)
    assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert done["output_ids"] == aborted["output_ids"][:3]  # greedy: same prefix


async def test_prompts_admitted_together_are_prefilled_in_one_forward_as_if_each_ran_alone(
    private_engine,
):
    """Held by a pause, then admitted in one step: one right-padded prefill forward, and every
    answer (tokens, output and input logprobs) is what the prompt gets alone."""
    url = private_engine.url
    prompts = [[40 + i] * (1 + 3 * i) + PROMPT for i in range(5)]  # different lengths
    bodies = [
        {
            "input_ids": p,
            "sampling_params": {"max_new_tokens": 0 if i == 4 else 6 + i, "temperature": 0},
            "return_logprob": True,
            # Some ask for input logprobs, some not; the last only for them (no new token).
            "logprob_start_len": 0 if i in (1, 3, 4) else -1,
        }
        for i, p in enumerate(prompts)
    ]
    alone = [(await post(url, "/generate", body)).json() for body in bodies]
    await post(url, "/pause_generation", {"mode": "abort"})
    try:
        together = asyncio.gather(*(post(url, "/generate", body) for body in bodies))

        async def held() -> bool:
            return (await stats(url))["num_waiting_reqs"] == len(bodies)

        await wait_for(held)
        before = await stats(url)
    finally:
        await post(url, "/continue_generation", {})
    answers = [r.json() for r in await asyncio.wait_for(together, 30)]
    after = await stats(url)
    assert after["num_prefills"] - before["num_prefills"] == len(bodies)
    assert after["num_prefill_batches"] - before["num_prefill_batches"] == 1
    for single, batched in zip(alone, answers, strict=True):
        assert batched["output_ids"] == single["output_ids"]
        a, b = single["meta_info"], batched["meta_info"]
        assert a["finish_reason"] == b["finish_reason"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            assert [t[1] for t in b.get(key, [])] == [t[1] for t in a.get(key, [])]
            torch.testing.assert_close(
                torch.tensor([t[0] for t in b.get(key, []) if t[0] is not None]),
                torch.tensor([t[0] for t in a.get(key, []) if t[0] is not None]),
                atol=1e-4,
                rtol=1e-4,
            )
    assert len(answers[1]["meta_info"]["input_token_logprobs"]) == len(prompts[1])
    assert answers[4]["output_ids"] == [] and answers[4]["meta_info"]["input_token_logprobs"]


async def test_abort_request_by_rid(slow_engine):
    url = slow_engine.url
    body = {
        "input_ids": PROMPT,
        # Sampled: ignore_eos keeps it running until aborted, whatever it samples.
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
        "rid": "steep-abort-me",
        "return_logprob": True,
    }
    running = asyncio.create_task(post(url, "/generate", body))
    await wait_for(lambda: _running(url))
    duplicate = await post(url, "/generate", body)
    assert duplicate.status_code == 400 and "already in flight" in duplicate.json()["message"]
    assert (await post(url, "/abort_request", {"rid": "steep-abort-me"})).status_code == 200
    data = (await asyncio.wait_for(running, 10)).json()
    assert data["meta_info"]["id"] == "steep-abort-me"
    assert data["meta_info"]["finish_reason"]["type"] == "abort"


async def _running(url: str) -> bool:
    return (await stats(url))["num_running_reqs"] > 0


async def test_disconnected_client_frees_its_request(slow_engine):
    url = slow_engine.url
    task = asyncio.create_task(generate(url, PROMPT, max_new_tokens=300, ignore_eos=True))
    await wait_for(lambda: _running(url))
    task.cancel()  # closes the connection

    async def idle() -> bool:
        return not await _running(url)

    await wait_for(idle, timeout=10)


async def test_update_weights_from_disk_swaps_weights_and_version(
    private_engine, tiny_model_dir, perturbed_model_dir, reference
):
    url = private_engine.url
    before = await generate(url, PROMPT, max_new_tokens=16, temperature=0)
    response = await post(
        url,
        "/update_weights_from_disk",
        {"model_path": str(perturbed_model_dir), "weight_version": "1"},
    )
    assert response.status_code == 200
    assert response.json()["success"] is True
    assert (await get(url, "/model_info")).json()["weight_version"] == "1"
    after = await generate(url, PROMPT, max_new_tokens=16, temperature=0)
    assert after["meta_info"]["weight_version"] == "1"
    assert after["output_ids"] == reference.greedy(perturbed_model_dir, PROMPT, 16)
    assert after["output_ids"] != before["output_ids"]
    expected = reference.logprobs(perturbed_model_dir, PROMPT, after["output_ids"])
    torch.testing.assert_close(
        torch.tensor([t[0] for t in after["meta_info"]["output_token_logprobs"]]),
        expected,
        atol=1e-4,
        rtol=1e-4,
    )

    # Back to the original weights: outputs are the original ones again.
    restore = {"model_path": str(tiny_model_dir), "weight_version": "2"}
    assert (await post(url, "/update_weights_from_disk", restore)).json()["success"] is True
    again = await generate(url, PROMPT, max_new_tokens=16, temperature=0)
    assert again["output_ids"] == before["output_ids"]
    assert again["meta_info"]["weight_version"] == "2"


async def test_update_swaps_under_running_requests_unless_told_to_abort(
    slow_engine, tiny_model_dir
):
    url = slow_engine.url
    running = asyncio.create_task(generate(url, PROMPT, max_new_tokens=40, temperature=0))
    await wait_for(lambda: _running(url))
    update = await post(
        url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "7"}
    )
    assert update.json()["success"] is True
    assert update.json()["swap_seconds"] >= 0
    finished = await asyncio.wait_for(running, 10)
    # Not aborted: the request went on under the new weights; its tokens say which made them.
    meta = finished["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    spans = meta["weight_versions"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 40
    assert spans[-1]["version"] == "7" == meta["weight_version"]
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False))

    running = asyncio.create_task(generate(url, PROMPT, max_new_tokens=300, temperature=0))
    await wait_for(lambda: _running(url))
    update = await post(
        url,
        "/update_weights_from_disk",
        {"model_path": str(tiny_model_dir), "weight_version": "8", "abort_all_requests": True},
    )
    assert update.json()["success"] is True
    aborted = await asyncio.wait_for(running, 10)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"


def test_engine_module_serves_the_documented_cli(tiny_model_dir: Path):
    from rl_core.inference.torch_engine.__main__ import _parse_args

    args = _parse_args(
        [
            "--model-path",
            str(tiny_model_dir),
            "--port",
            "1234",
            "--max-running-requests",
            "4",
            "--weight-version",
            "3",
        ]
    )
    assert (args.port, args.max_running_requests, args.weight_version, args.host) == (
        1234,
        4,
        "3",
        "127.0.0.1",
    )


def test_a_failure_after_a_batched_prefill_aborts_its_requests_and_the_engine_serves_on(
    tiny_model_dir: Path, monkeypatch
):
    """Sampling the first tokens of a prefilled batch fails: each of its requests gets an abort
    (none waits forever), and the next request is served as usual."""
    import threading

    from transformers import AutoTokenizer

    from rl_core.inference.torch_engine import engine as engine_module
    from rl_core.inference.torch_engine.protocol import parse_generate_request

    model = engine_module.load_model(str(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    engine = engine_module.TorchEngine(model, tokenizer, model_path=str(tiny_model_dir))
    sample = engine_module.sample_tokens
    calls = []

    def failing_once(*args: Any) -> list[int]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("sampling broke")
        return sample(*args)

    monkeypatch.setattr(engine_module, "sample_tokens", failing_once)
    results: dict[str, dict] = {}
    finished = threading.Event()

    def submit(rid: str, expected: int) -> None:
        body = {
            "input_ids": PROMPT[: 3 + len(rid)],
            "rid": rid,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        }
        req = parse_generate_request(body, tokenizer=tokenizer, vocab_size=engine.vocab_size)

        def sink(payload: dict, final: bool) -> None:
            if final:
                results[rid] = payload
                if len(results) == expected:
                    finished.set()

        req.sink = sink
        engine.submit(req)

    for rid in ("a", "bb", "ccc"):  # queued before the scheduler starts: one prefill batch
        submit(rid, 3)
    engine.start()
    try:
        assert finished.wait(60)
        assert engine.stats["num_prefill_batches"] == 1
        for rid in ("a", "bb", "ccc"):
            reason = results[rid]["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "sampling broke" in reason["message"]
        finished.clear()
        submit("next", 4)
        assert finished.wait(60)
    finally:
        engine.stop()
    assert results["next"]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
