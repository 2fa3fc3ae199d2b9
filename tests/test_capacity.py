"""What a run asks of the Ray cluster (workers.capacity): pure rules, no Ray."""

from __future__ import annotations

import pytest

from rl_core.config import RunConfig
from workers.capacity import (
    CapacityError,
    check_capacity,
    placement_timeout_s,
    resolve_backend,
    run_needs,
    wait_reason,
)

GPU_NODE = {"GPU": 8.0, "CPU": 64.0}
CPU_NODE = {"CPU": 4.0}


def config(**settings) -> RunConfig:
    return RunConfig.from_dict({"base_model": "m", "mode": "online", **settings})


def test_auto_picks_sglang_on_a_cluster_with_gpus_and_the_torch_engine_without():
    assert resolve_backend("auto", GPU_NODE) == "sglang"
    assert resolve_backend("auto", CPU_NODE) == "torch"
    assert resolve_backend("torch", GPU_NODE) == "torch"
    with pytest.raises(CapacityError, match="no GPUs"):
        resolve_backend("sglang", CPU_NODE)


def test_each_trainer_worker_and_sglang_server_takes_a_gpu():
    needs = run_needs(config(train_workers=4, num_inference_servers=3), "sglang", GPU_NODE)
    assert (needs.kind, needs.total) == ("GPU", 7.0)
    assert needs.trainer_bundle == {"CPU": 1.0, "GPU": 1.0}
    # A torch engine on a GPU cluster takes a CPU, not a GPU.
    assert run_needs(config(train_workers=4), "torch", GPU_NODE).total == 4.0
    on_cpus = run_needs(config(train_workers=2, num_inference_servers=2), "torch", CPU_NODE)
    assert (on_cpus.kind, on_cpus.total, on_cpus.trainer_bundle) == ("CPU", 4.0, {"CPU": 1.0})


def test_a_run_larger_than_the_cluster_is_refused_with_the_numbers():
    with pytest.raises(CapacityError) as caught:
        check_capacity(config(train_workers=4), "sglang", {"GPU": 2.0, "CPU": 16.0})
    assert str(caught.value).startswith(
        "train_workers=4 and 1 SGLang server need 5 GPUs; the cluster has 2."
    )
    check_capacity(config(train_workers=7), "sglang", GPU_NODE)  # exactly fits


def test_the_placement_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("STEEP_PLACEMENT_TIMEOUT_S", raising=False)
    assert placement_timeout_s() == 600.0
    monkeypatch.setenv("STEEP_PLACEMENT_TIMEOUT_S", "45")
    assert placement_timeout_s() == 45.0
    for bad in ("soon", "0"):
        monkeypatch.setenv("STEEP_PLACEMENT_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="STEEP_PLACEMENT_TIMEOUT_S"):
            placement_timeout_s()


def test_a_run_that_fits_the_totals_but_not_what_is_free_waits_naming_the_holders():
    run = config(train_workers=1, lora_rank=8, inference_pool="shared")
    one_gpu = {"GPU": 1.0, "CPU": 16.0}
    assert wait_reason(run, "sglang", one_gpu, {"pool shared": 1.0}) == (
        "waiting for 1 GPU for the trainer: 0 of 1 free; pool shared holds 1"
    )
    assert wait_reason(run, "sglang", one_gpu, {"pool shared": 0.0}) == ""
    own = config(train_workers=2, num_inference_servers=2)
    assert wait_reason(own, "torch", {"CPU": 6.0}, {"pool a": 2.0, "run 'b'": 1.0}) == (
        "waiting for 4 CPUs for the trainer and 2 inference servers: 3 of 6 free; "
        "pool a holds 2, run 'b' holds 1"
    )


def test_a_run_larger_than_the_whole_cluster_is_not_kept_waiting():
    # Nothing that stops would ever free enough: check_capacity refuses it with the numbers.
    assert wait_reason(config(train_workers=4), "sglang", {"GPU": 2.0}, {"pool a": 2.0}) == ""


def test_a_vllm_server_takes_its_tensor_parallel_gpus_on_gpus_and_a_cpu_without():
    big = config(train_workers=2, num_inference_servers=2, inference_tensor_parallel=4)
    assert run_needs(big, "vllm", GPU_NODE).total == 2 + 2 * 4
    assert run_needs(big, "sglang", GPU_NODE).server_resources == {"CPU": 1.0, "GPU": 4.0}
    # vLLM's CPU build: a CPU, as the torch engine.
    small = config(train_workers=1, num_inference_servers=2)
    assert run_needs(small, "vllm", CPU_NODE).server_resources == {"CPU": 1.0}
    assert resolve_backend("vllm", CPU_NODE) == "vllm"
    with pytest.raises(CapacityError) as caught:
        check_capacity(big, "vllm", {"GPU": 8.0, "CPU": 64.0})
    assert str(caught.value).startswith(
        "train_workers=2 and 2 vLLM servers of 4 GPUs each need 10 GPUs; the cluster has 8."
    )


def test_tensor_parallel_on_a_cluster_without_gpus_is_refused_saying_why():
    with pytest.raises(CapacityError, match="inference_tensor_parallel=2 splits each"):
        check_capacity(config(inference_tensor_parallel=2), "vllm", CPU_NODE)
