"""The cluster simulation (issue 19): cost models, the simulated clock, the SGLang stand-in,
and Steep's own loop driving 4 stand-in servers and 2 trainer GPUs in simulated time."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from rl_core.inference.client import IN_PROCESS_TRANSPORTS, InferenceClient
from rl_core.sim.clock import charge, run_simulated
from rl_core.sim.cluster import ClusterSimConfig, simulate
from rl_core.sim.cost import EngineCost, TrainerCost
from rl_core.sim.server import SimServer

ENGINE = EngineCost(
    name="round",
    params=1e9,
    base_s=0.010,
    per_seq_s=0.001,
    per_kv_token_s=0.0001,
    prefill_per_token_s=0.0005,
    max_running_requests=8,
)
TRAINER = TrainerCost(params=1e9, gpus=2, mfu=0.5, peak_flops=1e15, broadcast_Bps=1e9)


def test_a_decode_step_costs_base_plus_per_sequence_plus_per_cached_token():
    # 10 ms + 4 x 1 ms + 1,000 x 0.1 ms
    assert ENGINE.step_seconds(4, 1000) == pytest.approx(0.114)
    assert ENGINE.step_seconds(0, 0) == 0.0
    assert ENGINE.prefill_seconds(200) == pytest.approx(0.1)


def test_a_training_step_costs_six_flops_per_parameter_per_token_over_the_gpus():
    # 1e6 tokens x 6 x 1e9 params / (2 GPUs x 1e15 FLOP/s x 0.5) = 6 s
    assert TRAINER.step_seconds(1_000_000) == pytest.approx(6.0)
    assert TRAINER.weight_bytes() / TRAINER.broadcast_Bps == pytest.approx(2.0)


def test_the_simulated_clock_jumps_and_charges_blocking_work():
    def blocking() -> str:
        charge(5.0)
        return "trained"

    async def main() -> tuple[float, str, float]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(30)
        slept = loop.time()
        result, _ = await asyncio.gather(asyncio.to_thread(blocking), asyncio.sleep(2))
        return slept, result, loop.time()

    assert run_simulated(main()) == (30.0, "trained", 35.0)


def test_a_known_batch_on_the_stand_in_takes_the_cost_models_time():
    server = SimServer(ENGINE, TRAINER, lambda seed: 5)
    url = "http://sim-test.invalid:1"

    async def main() -> tuple[list, float]:
        IN_PROCESS_TRANSPORTS[url] = httpx.ASGITransport(app=server)
        try:
            async with InferenceClient(url) as client:
                results = await asyncio.gather(
                    *(
                        client.generate([7] * 10, {"max_new_tokens": 64, "sampling_seed": s})
                        for s in (1, 2)
                    )
                )
        finally:
            IN_PROCESS_TRANSPORTS.pop(url)
            await server.aclose()
        return results, asyncio.get_running_loop().time()

    results, elapsed = run_simulated(main())
    # Both join one prefill of 20 tokens, then 5 decode steps of 2 requests whose cache
    # holds 20 prompt tokens plus, on average over the steps, 2 x 5 // 2 generated ones.
    expected = ENGINE.prefill_seconds(20) + 5 * ENGINE.step_seconds(2, 20 + 5)
    assert elapsed == pytest.approx(expected)
    assert [len(r.output_ids) for r in results] == [5, 5]
    assert all(r.finish_reason == "stop" and r.versions == [0] * 5 for r in results)


def _against(server: SimServer, scenario: Any) -> Any:
    """Run ``scenario(client)`` against ``server`` on the simulated clock; its result."""
    url = f"http://sim-{id(server)}.invalid:1"

    async def main() -> Any:
        IN_PROCESS_TRANSPORTS[url] = httpx.ASGITransport(app=server)
        try:
            async with InferenceClient(url) as client:
                return await scenario(client)
        finally:
            IN_PROCESS_TRANSPORTS.pop(url)
            await server.aclose()

    return run_simulated(main())


def test_a_weight_update_mid_generation_tags_the_later_tokens_with_the_new_version():
    async def update_mid_generation(client: InferenceClient) -> Any:
        generation = asyncio.create_task(client.generate([7] * 4, {"max_new_tokens": 100}))
        await asyncio.sleep(0.5)
        await client.pause_generation("in_place")
        await client.update_weights_from_distributed(
            ["model"], ["bfloat16"], [[1000]], group_name="g", weight_version=1
        )
        await client.continue_generation()
        return await generation

    result = _against(SimServer(ENGINE, TRAINER, lambda seed: 100), update_mid_generation)
    first_new = result.versions.index(1)
    assert 0 < first_new < 100
    assert result.versions == [0] * first_new + [1] * (100 - first_new)


def test_an_answer_aborted_by_rid_resumes_where_it_stopped():
    async def abort_mid_generation(client: InferenceClient) -> Any:
        generation = asyncio.create_task(
            client.generate([7] * 4, {"max_new_tokens": 500}, rid="r1")
        )
        await asyncio.sleep(0.5)
        await client.abort_request("r1")  # the client's resume loop sends it again
        return await generation

    server = SimServer(ENGINE, TRAINER, lambda seed: 100)
    result = _against(server, abort_mid_generation)
    # 100 tokens in all, not 100 more after the abort.
    assert len(result.output_ids) == 100 and result.finish_reason == "stop"
    assert result.num_segments == 2 and server.stats.requests == 2


@pytest.fixture(scope="module")
def small_runs():
    # 4 servers, 2 trainer GPUs, 20 steps, long-tailed lengths: seeded and in simulated
    # time, so the numbers are the same on any machine, however loaded.
    small = dict(servers=4, trainer_gpus=2, steps=20, lengths="longtail", seed=0)
    return {s: simulate(ClusterSimConfig(max_staleness=s, **small)) for s in (0, 4)}


def test_the_small_simulation_never_trains_a_token_beyond_the_staleness_bound(small_runs):
    for staleness, result in small_runs.items():
        assert result.steps == 20
        assert result.staleness, "nothing was trained"
        assert max(result.staleness) <= staleness
    assert set(small_runs[0].staleness) == {0}


def test_async_beats_sync_on_the_long_tailed_distribution_by_a_wide_margin(small_runs):
    sync, async_ = small_runs[0], small_runs[4]
    # Measured 5.3x in simulated time; 2x leaves room for cost-model tuning, not for noise
    # (there is none: the clock is simulated).
    assert async_.trajectories_per_s > 2.0 * sync.trajectories_per_s
    assert async_.trained_tokens_per_s > 1.5 * sync.trained_tokens_per_s
    assert async_.inference_idle < sync.inference_idle


def test_a_lora_run_that_moves_its_answers_onto_each_new_adapter_drops_fewer_of_them():
    # The Ray job's LoRA sync moves the answers in flight onto each new adapter; "lora-keep"
    # leaves each under the adapter it started with, so a long answer ages whole.
    small = dict(servers=4, trainer_gpus=2, steps=20, lengths="longtail", seed=0, max_staleness=4)
    moved = simulate(ClusterSimConfig(weight_sync="lora", **small))
    kept = simulate(ClusterSimConfig(weight_sync="lora-keep", **small))
    assert max(moved.staleness) <= 4 and max(kept.staleness) <= 4
    assert moved.dropped < kept.dropped
    assert moved.trained_tokens_per_s > kept.trained_tokens_per_s


def test_online_agents_beyond_the_staleness_budget_are_refused_and_the_bound_holds():
    from rl_core.sim.agents import AgentSimConfig, simulate_agents

    cluster = ClusterSimConfig(
        servers=2,
        trainer_gpus=1,
        batch_size=8,
        max_staleness=1,
        steps=6,
        min_tokens=64,
        max_tokens=1024,
    )
    result = simulate_agents(cluster, AgentSimConfig(agents=40, think_s=1.0))
    assert result.steps == 6
    # 40 agents, at most (1 + version + 1) x 8 sessions admitted: most must wait.
    assert result.refusals > 0 and 0 < result.backoff_fraction < 1
    assert result.max_staleness_seen <= 1
    assert result.sessions_trained == 6 * 8


def test_the_synchronous_bound_adds_generation_and_training_the_asynchronous_one_overlaps_them():
    from rl_core.sim.cluster import ideal_trajectories_per_s

    common = dict(servers=4, trainer_gpus=1, batch_size=64, lengths="uniform", seed=0)
    sync = ClusterSimConfig(max_staleness=0, **common)
    async_ = ClusterSimConfig(max_staleness=1, **common)
    train_s = async_.trainer_cost().step_seconds(int(64 * (256 + async_.mean_length())))
    # No overlap in sync: its step is generation + training, so it is below the training rate.
    assert ideal_trajectories_per_s(sync) < 64 / train_s
    # Perfect overlap: a step takes the longer of the two, never less than training alone.
    assert ideal_trajectories_per_s(async_) <= 64 / train_s + 1e-9
    assert ideal_trajectories_per_s(async_) > ideal_trajectories_per_s(sync)


def test_the_per_token_bound_trains_everything_when_answers_fit_the_staleness_window():
    from rl_core.sim.cluster import fresh_fraction

    # Answers of 512-1,222 tokens (uniform, the long tail's mean) decode in ~7 s; a version
    # lasts ~6.7 s (256 trajectories on one trainer GPU), so 3 versions hold every answer.
    short = ClusterSimConfig(
        lengths="uniform",
        min_tokens=512,
        max_tokens=1024,
        max_staleness=2,
        batch_size=256,
        trainer_gpus=1,
    )
    assert fresh_fraction(short) == 1.0
    assert fresh_fraction(ClusterSimConfig(max_staleness=0)) == 1.0


def test_the_per_token_bound_masks_more_of_the_long_tail_for_larger_groups_and_less_with_more_staleness():
    from rl_core.sim.cluster import fresh_fraction

    tail = dict(servers=24, trainer_gpus=8, batch_size=384, min_tokens=1024, max_tokens=32768)
    # At one per-server batch (one decode speed), so only the rule's window differs.
    f = {
        (g, s): fresh_fraction(ClusterSimConfig(group_size=g, max_staleness=s, **tail), batch=32)
        for g in (1, 8)
        for s in (4, 8)
    }
    assert all(0.0 < v < 1.0 for v in f.values())
    # A group's early finishers wait, aging, for its longest answer.
    assert f[8, 4] < f[1, 4] and f[8, 8] < f[1, 8]
    assert f[1, 4] < f[1, 8] and f[8, 4] < f[8, 8]


def test_the_per_token_bound_is_the_best_batch_below_the_bound_that_trains_every_token():
    from rl_core.sim.cluster import fresh_fraction, ideal_trajectories_per_s, per_token_bound

    tail = dict(servers=24, trainer_gpus=8, batch_size=384, min_tokens=1024, max_tokens=32768)
    cfg = ClusterSimConfig(group_size=8, max_staleness=4, **tail)
    every_token = ideal_trajectories_per_s(cfg) * cfg.mean_length()
    tokens, batch = per_token_bound(cfg)
    assert 0 < tokens < every_token
    # At least what the budget's full batch trains (the maximum is over batches).
    assert tokens >= every_token * fresh_fraction(cfg, groups=2000) - 1e-6
    assert 1 <= batch <= 4 * 384 / 24
    sync = ClusterSimConfig(group_size=8, max_staleness=0, **tail)
    assert per_token_bound(sync)[0] == pytest.approx(
        ideal_trajectories_per_s(sync) * sync.mean_length()
    )


def test_the_slot_occupancy_accounts_for_the_whole_staleness_budget(small_runs):
    result = small_runs[4]
    budget = (4 + 1) * result.config["batch_size"]
    assert sum(result.slots.values()) == pytest.approx(budget)
    assert result.slots["decoding"] > 0 and result.slots["group_wait"] > 0
