"""The trainer as Ray actors on a real local Ray (CPU, gloo): two FSDP2 workers take steps,
save weights and checkpoints, resume; a run too big for the cluster fails with the numbers;
a failing worker takes the whole group down instead of leaving the other blocked."""

from __future__ import annotations

import time

import pytest
import torch

from rl_core.config import RunConfig
from rl_core.types import Trajectory
from tests.localray import local_ray as local_ray_head
from workers.capacity import CapacityError

pytestmark = pytest.mark.slow

CPUS = 2


@pytest.fixture(scope="module")
def local_ray():
    import ray

    with local_ray_head("steep-ray-tg-", num_cpus=CPUS):
        yield ray


def _config(model_dir, **overrides) -> RunConfig:
    return RunConfig.from_dict(
        {
            "base_model": str(model_dir),
            "mode": "online",
            "batch_size": 4,
            "ppo_minibatches": 2,
            "learning_rate": 1e-3,
            "micro_batch_tokens": 16,
            "train_workers": 2,
            **overrides,
        }
    )


def _group(config: RunConfig):
    """The trainer workers of ``config``, one CPU and one torch thread each."""
    from workers.trainer_group import TrainerGroup

    return TrainerGroup(
        config, bundle={"CPU": 1.0}, placement_timeout_s=120, env={"STEEP_TORCH_THREADS": "1"}
    )


def _batch() -> list[Trajectory]:
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(4):
        ids = torch.randint(0, 256, (6 + 3 * i,), generator=g).tolist()
        mask = [0, 0] + [1] * (len(ids) - 2)
        logprobs = [-1.5 * m for m in mask]
        versions = [0 if m else -1 for m in mask]
        trajs.append(Trajectory(ids, mask, logprobs, versions, [float(i % 2)]))
    return trajs


def _weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_two_trainer_actors_train_save_and_resume(local_ray, tiny_model_dir, tmp_path):
    group = _group(_config(tiny_model_dir))
    try:
        assert group.version == 0
        batch = _batch()
        group.save_weights(str(tmp_path / "w0"))
        stats = group.train_step(batch)
        assert group.version == 1 and stats["version"] == 1.0
        assert stats["rollout/num_trajectories"] == 4.0 and stats["ppo/grad_norm"] > 0
        group.save_checkpoint(str(tmp_path / "ckpt"))
        group.save_weights(str(tmp_path / "w1"))
        group.train_step(batch)
        group.save_weights(str(tmp_path / "w2"))

        group.load_checkpoint(str(tmp_path / "ckpt"))
        assert group.version == 1
        group.train_step(batch)
        group.save_weights(str(tmp_path / "w2-again"))
    finally:
        group.close()

    w0, w1, w2 = (_weights(tmp_path / name) for name in ("w0", "w1", "w2"))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0), "the first step changed the weights"
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    again = _weights(tmp_path / "w2-again")
    assert all(torch.equal(w2[k], again[k]) for k in w2), "a resumed step repeats the step exactly"
    assert (tmp_path / "ckpt" / "trainer_state.pt").exists()


def test_one_trainer_actor_writes_a_checkpoint_snapshot_beside_its_next_step(
    local_ray, tiny_model_dir, tmp_path
):
    # The loop's asynchronous checkpoint through Ray: the worker copies its state between two
    # steps, and its checkpoint thread writes the copy while the next step trains. The
    # checkpoint holds the step it was taken at.
    from concurrent.futures import ThreadPoolExecutor

    group = _group(_config(tiny_model_dir, train_workers=1))
    try:
        batch = _batch()
        group.train_step(batch)
        group.save_weights(str(tmp_path / "w1"))
        write = group.checkpoint_snapshot()
        assert write is not None
        with ThreadPoolExecutor(1) as pool:  # as the loop does: the write on its own thread
            written = pool.submit(write, str(tmp_path / "ckpt"))
            group.train_step(batch)
            assert written.result(timeout=120) == str(tmp_path / "ckpt")
        group.load_checkpoint(str(tmp_path / "ckpt"))
        assert group.version == 1
        group.save_weights(str(tmp_path / "w1-again"))
    finally:
        group.close()
    w1, again = _weights(tmp_path / "w1"), _weights(tmp_path / "w1-again")
    assert all(torch.equal(w1[k], again[k]) for k in w1), "the snapshot holds step 1"


def test_two_trainer_actors_save_their_checkpoints_in_step(local_ray, tiny_model_dir):
    group = _group(_config(tiny_model_dir))
    try:
        assert group.checkpoint_snapshot() is None  # a sharded save is a collective
    finally:
        group.close()


def test_one_trainer_actor_with_cpu_offload_shards_as_a_group_of_one(
    local_ray, tiny_model_dir, tmp_path
):
    group = _group(_config(tiny_model_dir, train_workers=1, cpu_offload=True))
    try:
        assert group.checkpoint_snapshot() is None  # FSDP2 even alone: saves in step
        batch = _batch()
        stats = group.train_step(batch)
        assert stats["ppo/grad_norm"] > 0
        group.save_checkpoint(str(tmp_path / "ckpt"))
        group.save_weights(str(tmp_path / "w1"))
        group.train_step(batch)
        group.load_checkpoint(str(tmp_path / "ckpt"))
        assert group.version == 1
        group.save_weights(str(tmp_path / "w1-again"))
    finally:
        group.close()
    assert (tmp_path / "ckpt" / "optimizer" / ".metadata").is_file()  # the sharded format
    w1, again = _weights(tmp_path / "w1"), _weights(tmp_path / "w1-again")
    assert all(torch.equal(w1[k], again[k]) for k in w1)


def test_trainer_workers_the_cluster_cannot_place_fail_with_the_numbers(local_ray, tiny_model_dir):
    from ray.util import placement_group_table

    from workers.trainer_group import TrainerGroup

    started = time.monotonic()
    with pytest.raises(CapacityError) as caught:
        TrainerGroup(
            _config(tiny_model_dir, train_workers=CPUS + 1),
            bundle={"CPU": 1.0},
            placement_timeout_s=3,
        )
    assert time.monotonic() - started < 30
    message = str(caught.value)
    assert f"train_workers={CPUS + 1}" in message and "within 3 s" in message, message
    assert f"{CPUS:g} CPU" in message, message
    states = [pg["state"] for pg in placement_group_table().values()]
    assert "PENDING" not in states and "CREATED" not in states, states  # given back


def test_a_failing_worker_stops_the_whole_group(local_ray, tiny_model_dir, tmp_path):
    import ray

    from workers.trainer_group import TrainerGroup

    group = TrainerGroup(_config(tiny_model_dir), bundle={"CPU": 1.0}, placement_timeout_s=120)
    actors = list(group._actors)
    # Rank 0 cannot read it; rank 1 waits in the broadcast that would follow.
    with pytest.raises(FileNotFoundError):
        group.load_checkpoint(str(tmp_path / "missing"))
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.train_step.remote([]), timeout=60)
    group.close()  # idempotent after the failure
    # Later calls (WeightSync's disk fallback, its group teardown) fail with a clear error.
    with pytest.raises(RuntimeError, match="trainer workers were stopped"):
        group.save_weights(str(tmp_path / "w"))
    with pytest.raises(RuntimeError, match="trainer workers were stopped"):
        group.destroy_weight_group("steep_weight_sync")


def test_a_worker_killed_inside_a_collective_is_reported_as_a_death_not_as_its_peers_error(
    local_ray,
):
    """Rank 0 killed mid-checkpoint breaks rank 1's gloo collective at once: rank 1's
    RuntimeError reaches the driver before Ray has noticed rank 0's death. The group raises the
    death (the job restarts the run) rather than rank 1's error (the job would fail the run)."""
    import os

    import ray

    from workers.trainer_group import TrainerGroup

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, dies: bool):
            self.dies = dies

        def save_checkpoint(self, path: str) -> str:
            if self.dies:
                time.sleep(2)  # Ray learns of the death after the peer's error has arrived
                os._exit(1)
            raise RuntimeError("[gloo] Connection closed by peer")

    group = TrainerGroup.__new__(TrainerGroup)  # the group of two workers, without trainers
    group._pg = None
    group._actors = [Worker.remote(True), Worker.remote(False)]
    ray.get([actor.__ray_ready__.remote() for actor in group._actors])
    with pytest.raises(ray.exceptions.RayActorError) as died:
        group.save_checkpoint("ckpt")
    assert "Connection closed by peer" in str(died.value.__cause__)
    assert group._actors == []  # every worker stopped
