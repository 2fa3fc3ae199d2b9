"""Pool statistics from a live torch engine: per attached run tokens/s, queue depth, and the
adapters the servers hold, on the staff page and the REST detail; never for a project key."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch
from django.test import Client

from rl_core.inference.launch import TorchEngineServer
from webapp.pools.services import pool_server_register, pool_transition

LORA = {"base_model": "tiny-llama", "lora_rank": 8}
PROMPT = [72, 101, 108, 108, 111]


def _adapter(base: Path, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=8, target_modules="all-linear")).save_pretrained(
        str(out), save_embedding_layers=False
    )
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """One engine for the module (a start is seconds of CPU): the first test loads an adapter
    into it, the last sets fair-share weights; neither looks at what the other left."""
    log = tmp_path_factory.mktemp("pool-engine") / "e.log"
    server = TorchEngineServer(
        tiny_model_dir, host="127.0.0.1", num_threads=1, lora_rank=8, log_path=log
    )
    server.start()
    try:
        server.wait_healthy(timeout=120)
        yield server
    finally:
        server.stop()


def _state(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]


def test_pool_stats_show_each_runs_tokens_queue_and_the_loaded_adapters_to_staff_only(
    engine, tiny_model_dir, tmp_path, staff, staff_api, api, api_error, make_pool, project,
    other_project, make_run, set_status,
):  # fmt: skip
    pool = pool_transition(pool=make_pool(name="shared"), to="starting")
    pool_server_register(pool=pool, url=engine.url, backend="torch")
    mine = set_status(make_run(project, name="mine", **LORA, inference_pool="shared"), "running")
    set_status(make_run(other_project, name="theirs", **LORA, inference_pool="shared"), "running")
    type(mine).objects.filter(pk=mine.pk).update(weight_version=1)
    name = f"{mine.id}-v1"
    loaded = httpx.post(
        f"{engine.url}/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(_adapter(tiny_model_dir, tmp_path / "a"))},
        timeout=60,
    )
    assert loaded.status_code == 200
    body = {"input_ids": PROMPT, "lora_path": name, "sampling_params": {"max_new_tokens": 4}}
    assert httpx.post(f"{engine.url}/generate", json=body, timeout=60).status_code == 200
    # Paused, the engine holds the next request in its queue: a queue depth of 1 for "mine".
    httpx.post(f"{engine.url}/pause_generation", json={}, timeout=30).raise_for_status()
    waiting = threading.Thread(
        target=lambda: httpx.post(f"{engine.url}/generate", json=body, timeout=120)
    )
    waiting.start()
    try:
        for _ in range(2400):  # the thread's request reaches the engine's queue
            if _state(engine.url)["num_waiting_reqs"] == 1:
                break
            waiting.join(0.05)
        stats = staff_api.get("/api/v1/pools/shared/").json()["stats"]
        page = Client()
        page.force_login(staff)
        html = page.get("/pools/").content.decode()
        api_error(api.get("/api/v1/pools/shared/"), 404)  # even the attached run's own key
    finally:
        httpx.post(f"{engine.url}/continue_generation", json={}, timeout=30)
        waiting.join(120)
    assert stats["servers_reporting"] == 1
    assert stats["loaded_adapters"] == [name] and stats["evicted_adapters"] == []
    runs = {r["run_name"]: r for r in stats["runs"]}
    assert runs["mine"]["queue_depth"] == 1 and runs["mine"]["running_requests"] == 0
    # 4 tokens over the engine's 10 s window (0 once they left it; TokenRates is unit-tested)
    assert 0 <= runs["mine"]["tokens_per_s"] <= 0.4
    assert runs["theirs"]["queue_depth"] == 0 and runs["theirs"]["tokens_per_s"] == 0.0
    assert "1 queued" in html and name in html


def test_a_server_that_does_not_report_shows_no_figures(
    staff_api, make_pool, project, make_run, set_status
):
    pool = pool_transition(pool=make_pool(name="shared"), to="starting")
    pool_server_register(pool=pool, url="http://127.0.0.1:9", backend="sglang")  # nothing there
    set_status(make_run(project, name="mine", **LORA, inference_pool="shared"), "running")
    stats = staff_api.get("/api/v1/pools/shared/").json()["stats"]
    assert stats["servers_reporting"] == 0 and stats["loaded_adapters"] == []
    (run,) = stats["runs"]
    assert (run["tokens_per_s"], run["queue_depth"], run["running_requests"]) == (None, None, None)


def test_staff_set_run_weights_and_the_pool_job_hands_them_to_its_torch_servers(
    engine, staff_api, api, api_error, make_pool
):
    import asyncio

    from workers.pool_job import push_fair_share_weights

    make_pool(name="shared")
    set_ok = staff_api.post(
        "/api/v1/pools/shared/run_weights/", {"run_weights": {"run-a": 3}}, format="json"
    )
    assert set_ok.status_code == 200 and set_ok.json()["run_weights"] == {"run-a": 3.0}
    for bad in ({"run_weights": {"run-a": 0}}, {"run_weights": ["run-a"]}, {}):
        api_error(staff_api.post("/api/v1/pools/shared/run_weights/", bad, format="json"), 400)
    api_error(
        api.post("/api/v1/pools/shared/run_weights/", {"run_weights": {}}, format="json"), 404
    )
    weights = staff_api.get("/api/v1/pools/shared/").json()["run_weights"]
    took = asyncio.run(push_fair_share_weights([engine.url, "http://127.0.0.1:9"], weights))
    assert took == [engine.url]  # the unreachable one is logged and retried later
    assert _state(engine.url)["fair_share_weights"] == {"run-a": 3.0}
