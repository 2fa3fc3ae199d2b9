"""LoRA adapters served natively by the torch engine (SGLang's protocol) and the adapter sync."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rl_core.inference.adapters import adapter_name, adapter_version, current_adapter
from rl_core.inference.client import InferenceClient, InferenceError

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "


def _make_adapter(base_dir: Path, out: Path, *, rank: int, targets: Any, seed: int) -> Path:
    """A peft adapter with random non-zero B (so it changes the model), saved in peft's format."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2.0 * rank, target_modules=targets, bias="none")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(str(out), save_embedding_layers=False)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": _make_adapter(tiny_model_dir, root / "a", rank=8, targets="all-linear", seed=1),
        "b": _make_adapter(
            tiny_model_dir, root / "b", rank=4, targets=["q_proj", "v_proj"], seed=2
        ),
    }


def _peft_logprobs(
    base_dir: Path, adapter: Path | None, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Log-probs of ``output`` under the base model plus ``adapter`` as peft computes them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


# --------------------------------------------------------------------------- in-process engine


def test_two_adapters_and_the_base_model_share_one_batch_with_their_own_logprobs(
    tiny_model_dir, adapters
):
    from transformers import AutoTokenizer

    from rl_core.inference.torch_engine.engine import TorchEngine, load_model
    from rl_core.inference.torch_engine.lora import AdapterSet
    from rl_core.inference.torch_engine.protocol import parse_generate_request

    model = load_model(str(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    lora = AdapterSet(model, max_lora_rank=8)
    engine = TorchEngine(model, tokenizer, model_path=str(tiny_model_dir), adapters=lora)
    lora.load("a", str(adapters["a"]))
    lora.load("b", str(adapters["b"]))
    results: dict[str, dict] = {}
    done = threading.Event()
    # Submitted before the scheduler starts: its first step admits all three into one batch.
    for rid, name in (("ra", "a"), ("rb", "b"), ("rbase", None)):
        body = {
            "input_ids": PROMPT,
            "rid": rid,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 3},
        }
        if name is not None:
            body["lora_path"] = name
        req = parse_generate_request(body, tokenizer=tokenizer, vocab_size=engine.vocab_size)

        def sink(payload: dict, final: bool, rid: str = rid) -> None:
            if final:
                results[rid] = payload
                if len(results) == 3:
                    done.set()

        req.sink = sink
        engine.submit(req)
    engine.start()
    try:
        assert done.wait(120)
    finally:
        engine.stop()
    assert engine.stats["max_batch_size_seen"] == 3  # decoded together
    assert engine.stats["num_decode_steps"] == 9  # one shared decode step per token after the first
    for rid, adapter in (("ra", adapters["a"]), ("rb", adapters["b"]), ("rbase", None)):
        meta = results[rid]["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        output = results[rid]["output_ids"]
        expected = _peft_logprobs(tiny_model_dir, adapter, PROMPT, output)
        assert torch.allclose(got, expected, atol=2e-3), (rid, got - expected)
        if adapter is not None:  # the adapter matters: the base model's logprobs differ
            base = _peft_logprobs(tiny_model_dir, None, PROMPT, output)
            assert (base - expected).abs().max() > 0.05
    # Every request released its adapter.
    assert all(lora.acquire(n).users == 1 for n in ("a", "b"))


def test_adapters_beyond_max_loras_per_batch_wait_for_a_slot(tiny_model_dir, adapters):
    from rl_core.inference.torch_engine.engine import load_model
    from rl_core.inference.torch_engine.lora import AdapterSet

    lora = AdapterSet(load_model(str(tiny_model_dir)), max_loras_per_batch=1)
    lora.load("a", str(adapters["a"]))
    lora.load("b", str(adapters["b"]))
    a, b = lora.acquire("a"), lora.acquire("b")
    assert lora.fits([a, None], a) and lora.fits([a], None)
    assert not lora.fits([a, None], b)


def test_adapter_loading_refuses_ranks_and_modules_it_cannot_serve(tiny_model_dir, adapters):
    from rl_core.inference.torch_engine.engine import load_model
    from rl_core.inference.torch_engine.lora import AdapterLoadError, AdapterSet

    lora = AdapterSet(load_model(str(tiny_model_dir)), max_lora_rank=4)
    with pytest.raises(AdapterLoadError, match="above --max-lora-rank 4"):
        lora.load("a", str(adapters["a"]))
    narrow = AdapterSet(load_model(str(tiny_model_dir)), target_modules=["q_proj"])
    with pytest.raises(AdapterLoadError, match="outside --lora-target-modules"):
        narrow.load("b", str(adapters["b"]))
    with pytest.raises(AdapterLoadError, match="holds no peft LoRA adapter"):
        narrow.load("c", str(tiny_model_dir))


# --------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def lora_engine(torch_engine_factory):
    return torch_engine_factory(weight_version=0, lora_rank=8)


async def _post(url: str, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as http:
        return await http.post(url + path, json=body)


async def test_load_and_unload_speak_sglangs_shapes_and_unknown_adapters_are_400(
    lora_engine, adapters, tiny_model_dir
):
    url = lora_engine.url
    response = await _post(
        url,
        "/load_lora_adapter",
        {"lora_name": "x", "lora_path": str(adapters["a"]), "pinned": False},
    )
    assert response.status_code == 200
    assert response.json() == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"x": str(adapters["a"])},
    }
    again = await _post(
        url, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["b"])}
    )
    assert again.status_code == 400
    assert again.json()["success"] is False and "already loaded" in again.json()["error_message"]

    async with InferenceClient(url) as client:
        result = await client.generate(
            PROMPT, {"max_new_tokens": 6, "temperature": 0}, lora_path="x"
        )
        expected = _peft_logprobs(tiny_model_dir, adapters["a"], PROMPT, result.output_ids)
        assert torch.allclose(torch.tensor(result.output_logprobs), expected, atol=2e-3)
        with pytest.raises(InferenceError) as unknown:
            await client.generate(PROMPT, {"max_new_tokens": 2}, lora_path="nope")
        assert unknown.value.status == 400 and "not loaded: nope" in str(unknown.value)
        unloaded = await client.unload_lora_adapter("x")
        assert unloaded == {"success": True, "error_message": "", "loaded_adapters": {}}
        gone = await _post(url, "/unload_lora_adapter", {"lora_name": "x"})
        assert gone.status_code == 400 and gone.json()["success"] is False
        with pytest.raises(InferenceError, match="not loaded: x"):
            await client.generate(PROMPT, {"max_new_tokens": 2}, lora_path="x")


async def test_unload_waits_for_the_requests_running_under_the_adapter(lora_engine, adapters):
    url = lora_engine.url
    async with InferenceClient(url) as client:
        await client.load_lora_adapter("slow", str(adapters["b"]))
        await client.slow_down(0.05)
        try:
            running = asyncio.create_task(
                client.generate(
                    PROMPT, {"max_new_tokens": 30, "ignore_eos": True}, lora_path="slow"
                )
            )
            while not (await client.get_server_info())["internal_states"][0]["num_running_reqs"]:
                await asyncio.sleep(0.01)
            await client.unload_lora_adapter("slow")
            assert running.done()  # the unload answered only once its request had finished
            result = running.result()
        finally:
            await client.slow_down(None)
    assert result.finish_reason == "length" and len(result.output_ids) == 30
    assert result.num_segments == 1  # never aborted


def test_adapter_names_carry_the_version():
    assert adapter_name("run7", 3) == "run7-v3"
    assert adapter_version("run7-v3") == 3 and adapter_version("other") is None
    assert current_adapter("run7", 0, lora_rank=8) is None  # version 0 is the base model
    assert current_adapter("run7", 0, lora_rank=8, init_checkpoint="/ckpt") == "run7-v0"
    assert current_adapter("run7", 4, lora_rank=8) == "run7-v4"
    assert current_adapter("run7", 4, lora_rank=0) is None


def test_launchers_pass_sglangs_lora_flags():
    from rl_core.inference.launch import SGLangServer, TorchEngineServer

    sglang = SGLangServer(
        "/m",
        lora_rank=16,
        lora_target_modules=["q_proj", "v_proj"],
        max_loras_per_batch=4,
        max_loaded_loras=6,
    )
    assert sglang.command()[-10:] == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
        "--max-loras-per-batch", "4", "--max-loaded-loras", "6",
    ]  # fmt: skip
    torch_cmd = TorchEngineServer("/m", lora_rank=8).command()
    assert torch_cmd[-5:] == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "all",
    ]
    assert "--enable-lora" not in SGLangServer("/m").command()


# --------------------------------------------------------------------------- adapter sync


def _perturb_adapter(trainer: Any, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)


def _trainer_logprobs(trainer: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


async def test_a_lora_sync_step_loads_a_new_adapter_and_retires_the_old_one_without_a_pause(
    torch_engine_factory, tiny_model_dir, tmp_path
):
    from rl_core.adapter_sync import AdapterSync
    from rl_core.trainer import PPOTrainer
    from tests.rl_core.test_trainer import _cfg

    server = torch_engine_factory(weight_version=0, lora_rank=8)
    trainer = PPOTrainer(_cfg(str(tiny_model_dir), lora_rank=8, lora_alpha=16.0))
    trainer.model.eval()
    sync = AdapterSync([server.url], tmp_path / "adapters", "run7", keep=1)
    try:
        trainer.version = 1
        _perturb_adapter(trainer, seed=11)
        assert await sync.push(trainer) == 1 and sync.current == "run7-v1"
        async with InferenceClient(server.url) as client:
            await client.slow_down(0.05)
            try:
                in_flight = asyncio.create_task(
                    client.generate(
                        PROMPT, {"max_new_tokens": 30, "ignore_eos": True}, lora_path="run7-v1"
                    )
                )
                while not (await client.get_server_info())["internal_states"][0][
                    "num_running_reqs"
                ]:
                    await asyncio.sleep(0.01)
                trainer.version = 2
                _perturb_adapter(trainer, seed=12)
                assert await sync.push(trainer) == 2 and sync.current == "run7-v2"
                await sync.drain()  # v1 is unloaded once its request has finished
                assert in_flight.done()
            finally:
                await client.slow_down(None)
            old = in_flight.result()
            # Not aborted, not resumed: no pause happened, and every token is version 1.
            assert old.finish_reason == "length" and len(old.output_ids) == 30
            assert old.num_segments == 1 and set(old.versions) == {1}
            state = (await client.get_server_info())["internal_states"][0]
            assert state["num_aborted_reqs"] == 0 and state["paused"] is False
            with pytest.raises(InferenceError, match="not loaded: run7-v1"):
                await client.generate(PROMPT, {"max_new_tokens": 2}, lora_path="run7-v1")
            new = await client.generate(
                PROMPT, {"max_new_tokens": 8, "temperature": 0}, lora_path="run7-v2"
            )
            assert set(new.versions) == {2}
            expected = _trainer_logprobs(trainer, PROMPT, new.output_ids)
            assert torch.allclose(torch.tensor(new.output_logprobs), expected, atol=2e-3)
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v2"]
    finally:
        await sync.aclose()


async def test_an_adapter_switch_moves_only_requests_lag_versions_behind_and_survives_a_failed_abort():
    from rl_core.inference.adapters import AdapterSwitch, move_lag

    class Server:
        def __init__(self, fail: bool = False):
            self.aborted: list[str] = []
            self.fail = fail

        async def abort_request(self, rid: str) -> None:
            if self.fail:
                raise InferenceError("gone")
            self.aborted.append(rid)

    one, gone = Server(), Server(fail=True)
    switch = AdapterSwitch(lag=2)
    switch.track("base", one, None)  # version 0 of a run that starts from the base model
    switch.track("v1", one, "run-v1")
    switch.track("v2", gone, "run-v2")
    switch.track("v3", one, "run-v3")
    # 4 - 0, 4 - 1 and 4 - 2 are >= 2, 4 - 3 is not; v2's server does not answer.
    assert await switch.switch("run-v4") == 2 and switch.switched == 2
    assert one.aborted == ["base", "v1"] and switch.current == "run-v4"
    # A segment starting now takes the newest adapter, whatever the lag.
    assert switch.newer("run-v3") == "run-v4" and switch.newer("run-v4") is None
    assert switch.newer("run-v5") is None  # never an older one
    switch.untrack("v1")
    assert set(switch._in_flight) == {"base", "v2", "v3"}
    assert [move_lag(s) for s in (0, 1, 2, 3, 4, 8)] == [1, 1, 1, 1, 2, 4]
    with pytest.raises(ValueError, match="lag >= 1"):
        AdapterSwitch(lag=0)


async def test_an_adapter_switch_moves_a_generation_in_flight_onto_the_new_version(
    torch_engine_factory, tiny_model_dir, tmp_path
):
    """With an AdapterSwitch the answer running under v1 goes on under v2 once v2 is loaded:
    its tokens before the switch are version 1's, those after are version 2's, generated by
    v2's weights (the trainer's logprobs), and v1 is unloaded without waiting for the answer."""
    from rl_core.adapter_sync import AdapterSync
    from rl_core.inference.adapters import AdapterSwitch
    from rl_core.trainer import PPOTrainer
    from tests.rl_core.test_trainer import _cfg

    server = torch_engine_factory(weight_version=0, lora_rank=8)
    trainer = PPOTrainer(_cfg(str(tiny_model_dir), lora_rank=8, lora_alpha=16.0))
    trainer.model.eval()
    switch = AdapterSwitch()
    sync = AdapterSync([server.url], tmp_path / "adapters", "run8", keep=1, switch=switch)
    try:
        trainer.version = 1
        _perturb_adapter(trainer, seed=11)
        await sync.push(trainer)
        assert switch.current == "run8-v1"
        async with InferenceClient(server.url) as client:
            await client.slow_down(0.15)  # 4.5 s of answer: the push lands inside it
            try:
                in_flight = asyncio.create_task(
                    client.generate(
                        PROMPT,
                        {"max_new_tokens": 30, "ignore_eos": True, "temperature": 0},
                        lora_path="run8-v1",
                        switch=switch,
                    )
                )
                # A few tokens under v1 first, however fast the push below is.
                while (await client.get_server_info())["internal_states"][0][
                    "num_generated_tokens"
                ] < 2:
                    await asyncio.sleep(0.01)
                trainer.version = 2
                _perturb_adapter(trainer, seed=12)
                await sync.push(trainer)
                assert sync.last_timing["weight_sync/requests_moved"] == 1.0
                await sync.drain()  # v1's unload: its only request left it
                assert not in_flight.done()  # ... while that request still runs, under v2
            finally:
                await client.slow_down(None)
            moved = await in_flight
            state = (await client.get_server_info())["internal_states"][0]
        assert moved.finish_reason == "length" and len(moved.output_ids) == 30
        assert moved.num_segments == 2 and switch.switched == 1
        k = moved.versions.count(1)
        assert 0 < k < 30 and moved.versions == [1] * k + [2] * (30 - k)
        assert state["num_aborted_reqs"] == 1 and state["paused"] is False
        expected = _trainer_logprobs(trainer, PROMPT, moved.output_ids)[k:]
        assert torch.allclose(torch.tensor(moved.output_logprobs[k:]), expected, atol=2e-3)
        assert switch._in_flight == {}  # untracked once finished
    finally:
        await sync.aclose()


async def test_the_rollout_driver_generates_under_the_current_versions_adapter(
    lora_engine, adapters, tiny_model_dir
):
    from rl_core.inference.adapters import AdapterSwitch
    from tests.rl_core.test_rollout import _cfg as rollout_cfg
    from tests.rl_core.test_rollout import _driver

    cfg = rollout_cfg(tiny_model_dir, lora_rank=8)
    switch = AdapterSwitch()
    driver = _driver(cfg, [lora_engine.url], adapter_prefix="runR", adapter_switch=switch)
    async with InferenceClient(lora_engine.url) as client:
        await client.load_lora_adapter("runR-v1", str(adapters["a"]))
        try:
            params = {"max_new_tokens": 4, "temperature": 0}
            base, _ = await driver._generate(client, PROMPT, params)  # version 0: the base model
            assert set(base.versions) == {0}
            # AdapterSync has switched to v1 (loaded everywhere) before the controller knows
            # of version 1: the driver's requests already take it.
            switch.current = "runR-v1"
            early, _ = await driver._generate(client, PROMPT, params)
            assert set(early.versions) == {1} and not switch._in_flight
            driver.controller.on_version(1)
            tuned, _ = await driver._generate(client, PROMPT, params)
            assert set(tuned.versions) == {1} and tuned.output_ids == early.output_ids
            expected = _peft_logprobs(tiny_model_dir, adapters["a"], PROMPT, tuned.output_ids)
            assert torch.allclose(torch.tensor(tuned.output_logprobs), expected, atol=2e-3)
        finally:
            await client.unload_lora_adapter("runR-v1")


async def test_fair_share_weights_are_set_over_http_and_runs_are_counted_in_server_info(
    lora_engine, adapters
):
    url = lora_engine.url
    set_ok = await _post(url, "/set_fair_share_weights", {"weights": {"run-a": 2, "run-b": 1}})
    assert set_ok.status_code == 200
    for bad in ({"weights": {"run-a": 0}}, {"weights": ["run-a"]}, {"weights": {"run-a": True}}):
        refused = await _post(url, "/set_fair_share_weights", bad)
        assert refused.status_code == 400, bad
    async with InferenceClient(url) as client:
        await client.load_lora_adapter("run-a-v3", str(adapters["a"]))
        try:
            await client.generate(
                PROMPT, {"max_new_tokens": 5, "ignore_eos": True}, lora_path="run-a-v3"
            )
        finally:
            await client.unload_lora_adapter("run-a-v3")
    async with httpx.AsyncClient(timeout=60) as http:
        info = (await http.get(url + "/get_server_info")).json()
    run_a = info["internal_states"][0]["tenants"]["run-a"]
    rate = run_a.pop("tokens_per_s")
    assert run_a == {"running_reqs": 0, "waiting_reqs": 0, "generated_tokens": 5, "weight": 2.0}
    assert 0 <= rate <= 0.5  # 5 tokens over the 10 s window (TokenRates: unit-tested)


# --------------------------------------------------------------------------- eviction


async def _server_state(url: str) -> dict:
    async with httpx.AsyncClient(timeout=60) as http:
        return (await http.get(url + "/get_server_info")).json()["internal_states"][0]


async def test_past_max_loaded_loras_the_least_recently_used_idle_adapter_is_evicted_and_reloaded_on_demand(
    torch_engine_factory, adapters
):
    engine = torch_engine_factory(lora_rank=8, max_loras_per_batch=2, max_loaded_loras=2)
    greedy = {"max_new_tokens": 6, "temperature": 0}
    async with InferenceClient(engine.url) as client:
        await client.load_lora_adapter("run-a-v1", str(adapters["a"]))
        await client.load_lora_adapter("run-b-v1", str(adapters["b"]))
        before = await client.generate(PROMPT, greedy, lora_path="run-a-v1")
        await client.generate(PROMPT, greedy, lora_path="run-b-v1")  # run-a is now the LRU
        await client.load_lora_adapter("run-c-v1", str(adapters["a"]))
        state = await _server_state(engine.url)
        assert state["loaded_adapters"] == ["run-b-v1", "run-c-v1"]
        assert state["evicted_adapters"] == ["run-a-v1"]
        assert state["num_adapter_evictions"] == 1

        # run-a's agents come back: its adapter is read again (evicting the LRU, run-b) and
        # serves exactly what it served before.
        after = await client.generate(PROMPT, greedy, lora_path="run-a-v1")
        assert after.output_ids == before.output_ids
        assert after.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-5)
        state = await _server_state(engine.url)
        assert state["loaded_adapters"] == ["run-a-v1", "run-c-v1"]
        assert state["evicted_adapters"] == ["run-b-v1"]
        assert (state["num_adapter_evictions"], state["num_adapter_reloads"]) == (2, 1)

        # Unloading an evicted adapter forgets it: no reload afterwards.
        assert (await client.unload_lora_adapter("run-b-v1"))["success"] is True
        with pytest.raises(InferenceError, match="not loaded: run-b-v1"):
            await client.generate(PROMPT, greedy, lora_path="run-b-v1")


def test_busy_and_pinned_adapters_are_never_evicted(tiny_model_dir, adapters):
    from rl_core.inference.torch_engine.engine import load_model
    from rl_core.inference.torch_engine.lora import AdapterLoadError, AdapterSet

    lora = AdapterSet(load_model(str(tiny_model_dir)), max_loras_per_batch=1, max_loaded_loras=2)
    lora.load("pinned-v1", str(adapters["a"]), pinned=True)
    lora.load("busy-v1", str(adapters["b"]))
    held = lora.acquire("busy-v1")  # a request is running under it
    with pytest.raises(AdapterLoadError, match="serving requests or pinned"):
        lora.load("new-v1", str(adapters["a"]))
    assert sorted(lora.loaded()) == ["busy-v1", "pinned-v1"]
    lora.release(held)
    lora.load("new-v1", str(adapters["a"]))  # now the idle busy-v1 goes
    assert sorted(lora.loaded()) == ["new-v1", "pinned-v1"] and lora.evicted() == ["busy-v1"]
    with pytest.raises(ValueError, match="at least --max-loras-per-batch"):
        AdapterSet(load_model(str(tiny_model_dir)), max_loras_per_batch=4, max_loaded_loras=2)
