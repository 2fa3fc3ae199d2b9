"""Weight sync (rl_core.weight_sync) against real torch-engine servers and a real PPOTrainer.

The distributed strategy is SGLang's protocol over a gloo group; the disk strategy is
update_weights_from_disk. Neither stops generation: a request in flight across an update
finishes unaborted with a mixed-version token list. A peer that dies mid-update is
detected within the watchdog time, reported, and never hangs anything.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.config import RunConfig
from rl_core.inference.client import InferenceClient, InferenceError
from rl_core.inference.process import free_port
from rl_core.loop import ListReporter
from rl_core.loop import WeightSync as LoopWeightSync
from rl_core.weight_sync import WeightSync, WeightSyncError

PROMPT = [72, 101, 108, 108, 111, 44, 32]
TIMEOUT_S = 8.0  # the watchdog in these tests


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path) -> Any:
    from rl_core.trainer import PPOTrainer

    cfg = RunConfig.from_dict(
        {"base_model": str(tiny_model_dir), "reward": {"type": "exact_match"}, "batch_size": 4}
    )
    return PPOTrainer(cfg, device="cpu")


def next_version(trainer: Any, seed: int) -> None:
    """Stand in for a train step: new weights (noised) and the next version."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.3 * param.std())
    trainer.version += 1


def trainer_logprobs(trainer: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = trainer.model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.fixture(scope="module")
def engine(torch_engine_factory: Any) -> Any:
    return torch_engine_factory(weight_version=0)


async def test_loop_module_still_exports_weight_sync():
    assert LoopWeightSync is WeightSync


async def test_distributed_update_matches_the_trainer_and_advances_the_version(
    engine: Any, trainer: Any, tmp_path: Path
):
    reporter = ListReporter()
    sync = WeightSync(
        [engine.url], tmp_path, strategy="distributed", timeout_s=TIMEOUT_S, reporter=reporter
    )
    client = InferenceClient(engine.url)
    try:
        for step in range(2):  # the second update reuses the group
            next_version(trainer, seed=step)
            assert await sync.push(trainer) == trainer.version
            assert await client.get_weight_version() == trainer.version
            result = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0})
            assert set(result.versions) == {trainer.version}
            torch.testing.assert_close(
                torch.tensor(result.output_logprobs),
                trainer_logprobs(trainer, PROMPT, result.output_ids),
                atol=2e-3,
                rtol=0,
            )
            timing = sync.last_timing
            assert timing["weight_sync/bytes"] > 0
            assert {"timing/weight_transfer", "timing/inference_stall"} <= set(timing)
        assert not list(tmp_path.glob("v*"))  # nothing went through the disk
        assert reporter.events == []
    finally:
        await client.aclose()
        await sync.aclose()


@pytest.mark.parametrize("strategy", ["distributed", "disk"])
async def test_a_request_in_flight_across_an_update_has_mixed_versions_and_is_not_aborted(
    engine: Any, trainer: Any, tmp_path: Path, strategy: str
):
    sync = WeightSync([engine.url], tmp_path, strategy=strategy, timeout_s=TIMEOUT_S)
    client = InferenceClient(engine.url)
    before = await client.get_weight_version()  # not trainer.version: a failed push may lag it
    await client.slow_down(0.05)
    try:
        running = asyncio.create_task(
            client.generate(PROMPT, {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True})
        )
        while (await client.get_server_info())["internal_states"][0]["num_running_reqs"] == 0:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # a few tokens under the old weights
        next_version(trainer, seed=10 + before)
        await sync.push(trainer)
        result = await asyncio.wait_for(running, 60)
    finally:
        await client.slow_down(None)
        await client.aclose()
        await sync.aclose()
    assert result.finish_reason == "length" and result.num_segments == 1  # never aborted
    assert len(result.versions) == 60
    assert result.versions[0] == before and result.versions[-1] == trainer.version
    assert result.versions == sorted(result.versions)  # old tokens, then new ones


SENDER = textwrap.dedent(
    """
    import os, sys, torch
    from rl_core.inference.weight_group import WeightGroup
    port, shapes = int(sys.argv[1]), eval(sys.argv[2])
    group = WeightGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                        group_name="g", timeout_s=float(sys.argv[3]))
    for shape in shapes[:2]:
        group.broadcast(torch.zeros(shape))
    os._exit(1)  # dies in the middle of the update
    """
)


async def test_a_sender_dying_mid_update_fails_the_update_and_the_engine_serves_on(
    engine: Any, trainer: Any
):
    meta = trainer.weight_metadata()
    client = InferenceClient(engine.url)
    port = free_port()
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(port), repr(meta["shapes"]), str(TIMEOUT_S)]
    )
    try:
        await asyncio.wait_for(
            client.init_weights_update_group(
                "127.0.0.1", port, 1, 2, group_name="g", backend="gloo", timeout_s=TIMEOUT_S
            ),
            TIMEOUT_S + 5,
        )
        version = await client.get_weight_version()
        greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        served = await client.generate(PROMPT, greedy)
        with pytest.raises(InferenceError) as failed:
            await asyncio.wait_for(  # bounded: the engine's group timeout answers first
                client.update_weights_from_distributed(
                    meta["names"], meta["dtypes"], meta["shapes"], group_name="g", weight_version=99
                ),
                TIMEOUT_S + 5,
            )
        assert failed.value.status == 400
        assert failed.value.body["success"] is False
        assert await client.get_weight_version() == version  # the old weights serve on
        # The old weights, whole: the same answer as before, to its logprobs; no tensor the dead
        # sender sent part of was kept. (Not "no EOS within 4 greedy tokens", which depended on
        # the updates the tests before this one had pushed.)
        result = await client.generate(PROMPT, greedy)
        assert result.output_ids == served.output_ids and set(result.versions) == {version}
        torch.testing.assert_close(
            torch.tensor(result.output_logprobs), torch.tensor(served.output_logprobs)
        )
        with pytest.raises(InferenceError):  # the broken group was dropped
            await client.destroy_weights_update_group("g")
    finally:
        sender.wait(timeout=30)
        await client.aclose()


class DyingSender:
    """A trainer whose broadcast breaks after two tensors (its group is torn down mid-update)."""

    def __init__(self, trainer: Any):
        self.inner = trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def broadcast_weights(self, group_name: str) -> dict[str, Any]:
        group = self.inner._sender.groups[group_name]
        real = group.broadcast
        count = {"n": 0}

        def broadcast(tensor: torch.Tensor) -> None:
            count["n"] += 1
            if count["n"] == 3:
                group.close()  # the sender's side goes away mid-update
            real(tensor)

        group.broadcast = broadcast
        return self.inner.broadcast_weights(group_name)


async def test_a_failed_broadcast_is_reported_and_falls_back_to_disk(
    torch_engine_factory: Any, trainer: Any, tmp_path: Path
):
    engine = torch_engine_factory(weight_version=0)
    reporter = ListReporter()
    sync = WeightSync(
        [engine.url], tmp_path, strategy="distributed", timeout_s=TIMEOUT_S, reporter=reporter
    )
    client = InferenceClient(engine.url)
    try:
        next_version(trainer, seed=20)
        await asyncio.wait_for(sync.push(DyingSender(trainer)), 4 * TIMEOUT_S)
        assert [kind for kind, _ in reporter.events] == ["weight_sync"]
        assert "now take(s) weights from disk" in reporter.events[0][1]
        assert await client.get_weight_version() == trainer.version  # delivered by disk
        assert list(tmp_path.glob("v*"))
        result = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
        torch.testing.assert_close(
            torch.tensor(result.output_logprobs),
            trainer_logprobs(trainer, PROMPT, result.output_ids),
            atol=2e-3,
            rtol=0,
        )
        next_version(trainer, seed=21)  # from now on this server takes disk updates
        await sync.push(trainer)
        assert await client.get_weight_version() == trainer.version
        assert len(reporter.events) == 1
    finally:
        await client.aclose()
        await sync.aclose()


@pytest.mark.slow
async def test_a_dead_server_is_reported_and_stops_the_sync_with_a_clear_error(
    torch_engine_factory: Any, trainer: Any, tmp_path: Path
):
    engine = torch_engine_factory(weight_version=0)
    reporter = ListReporter()
    sync = WeightSync(
        [engine.url], tmp_path, strategy="distributed", timeout_s=TIMEOUT_S, reporter=reporter
    )
    try:
        next_version(trainer, seed=30)
        await sync.push(trainer)  # the group is up
        engine.stop()
        next_version(trainer, seed=31)
        with pytest.raises(WeightSyncError, match="update_weights_from_disk"):
            await asyncio.wait_for(sync.push(trainer), 4 * TIMEOUT_S)
        assert [kind for kind, _ in reporter.events] == ["weight_sync"]
    finally:
        await sync.aclose()


@pytest.mark.parametrize("ifname", [None, "lo"])
def test_a_weight_group_binds_the_address_on_the_route_to_its_master(monkeypatch, ifname):
    import threading

    from rl_core.inference.weight_group import WeightGroup, local_address_towards

    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert local_address_towards("no-such-host.invalid") == ""  # torch's default then
    if ifname is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    else:  # the operator's interfaces win, as for torch's own groups
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", ifname)
    port, groups, tensors = free_port(), {}, {0: torch.arange(6.0), 1: torch.zeros(6)}

    def member(rank: int) -> None:
        groups[rank] = WeightGroup(
            master_address="127.0.0.1", master_port=port, rank=rank, world_size=2, timeout_s=20
        )
        groups[rank].broadcast(tensors[rank])

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert torch.equal(tensors[1], torch.arange(6.0))
    finally:
        for group in groups.values():
            group.close()


async def test_a_restarted_server_takes_the_current_weights_and_rejoins_the_group(
    torch_engine_factory: Any, trainer: Any, tmp_path: Path
):
    # What the job does when a server exited (workers.ray_job.watch_servers): updates leave
    # it out meanwhile (skip_unreachable), then it is started again on its URL, with the base
    # weights, and resynced.
    engine = torch_engine_factory(weight_version=0)
    reporter = ListReporter()
    sync = WeightSync(
        [engine.url],
        tmp_path,
        strategy="distributed",
        timeout_s=TIMEOUT_S,
        reporter=reporter,
        skip_unreachable=True,
    )
    client = InferenceClient(engine.url)
    try:
        next_version(trainer, seed=40)
        await sync.push(trainer)  # the group is up, with the old process in it
        engine.stop()
        next_version(trainer, seed=42)
        await asyncio.wait_for(sync.push(trainer), 4 * TIMEOUT_S)  # left out, not an error
        assert "unreachable" in reporter.events[-1][1]
        reporter.events.clear()
        engine.start()
        engine.wait_healthy(timeout=120)
        assert await client.get_weight_version() == 0  # the base model again

        await sync.resync(trainer, engine.url)

        assert await client.get_weight_version() == trainer.version
        result = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0})
        torch.testing.assert_close(
            torch.tensor(result.output_logprobs),
            trainer_logprobs(trainer, PROMPT, result.output_ids),
            atol=2e-3,
            rtol=0,
        )
        # The next update goes by broadcast again, through a group rebuilt with the new process.
        next_version(trainer, seed=41)
        await sync.push(trainer)
        assert await client.get_weight_version() == trainer.version
        assert "timing/save_weights" not in sync.last_timing
        assert reporter.events == []
    finally:
        await client.aclose()
        await sync.aclose(trainer)
