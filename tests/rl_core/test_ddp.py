"""Data parallel training: two CPU processes (gloo) take the step one process takes on the whole batch."""

import datetime
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rl_core.config import RunConfig
from rl_core.packing import pack, packed_logprobs
from rl_core.trainer import PPOTrainer
from rl_core.types import Trajectory

WORLD_SIZE = 2


def _cfg(model_path):
    # ppo_minibatches=2 over 5 trajectories: minibatches of 3 and 2, so rank 1 gets an
    # uneven share.
    return RunConfig.from_dict(
        {
            "base_model": model_path,
            "mode": "online",
            "batch_size": 5,
            "ppo_minibatches": 2,
            "learning_rate": 1e-4,
            "micro_batch_tokens": 16,
        }
    )


def _batch(trainer):
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(5):
        ids = torch.randint(0, 256, (5 + 2 * i,), generator=g).tolist()
        mask = [0, 0] + [1] * (len(ids) - 2)
        traj = Trajectory(ids, mask, [0.0] * len(ids), [0 if m else -1 for m in mask], [float(i)])
        with torch.no_grad():
            logprobs, _ = packed_logprobs(trainer.model, pack([traj]))
        # Slightly off-policy behaviour logprobs exercise the importance weights too.
        traj.logprobs = [(lp - 0.05 * i) * m for lp, m in zip(logprobs.tolist(), mask, strict=True)]
        trajs.append(traj)
    return trajs


def _flat_params(trainer):
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def _grads_at_optimizer_steps(trainer):
    """The gradients each optimizer step gets (all-reduced, clipped), one flat tensor per step."""
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.append(torch.cat([p.grad.detach().reshape(-1) for p in trainer.params]))
    )
    return seen


def _worker(rank, model_path, store, out_dir):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        trainer = PPOTrainer(_cfg(model_path), device="cpu")
        assert (trainer.rank, trainer.world_size) == (rank, WORLD_SIZE)
        grads = _grads_at_optimizer_steps(trainer)
        stats = trainer.train_step(_batch(trainer))
        torch.save(_flat_params(trainer), f"{out_dir}/params_{rank}.pt")
        torch.save(grads, f"{out_dir}/grads_{rank}.pt")
        with open(f"{out_dir}/stats_{rank}.json", "w") as f:
            json.dump(stats, f)
        trainer.save_checkpoint(f"{out_dir}/ckpt")  # rank 0 writes, both wait at the barrier
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return str(tiny_model_dir)


def test_two_ranks_end_with_identical_weights_equal_to_one_process(model_path, tmp_path):
    mp.spawn(
        _worker,
        args=(model_path, str(tmp_path / "store"), str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=True,
    )

    rank0 = torch.load(tmp_path / "params_0.pt")
    rank1 = torch.load(tmp_path / "params_1.pt")
    assert torch.equal(rank0, rank1)

    single = PPOTrainer(_cfg(model_path), device="cpu")
    initial = _flat_params(single)
    single_grads = _grads_at_optimizer_steps(single)
    single_stats = single.train_step(_batch(single))
    assert not torch.equal(initial, rank0)
    # The same step is the same gradients at each optimizer step, not the same parameters
    # after it: Adam's first update is about lr * sign(g), which float summation order can
    # flip for a near-zero g. Two ranks sum in another order than one process, so compare
    # within float32 noise of each step's largest gradient (a wrong reduction is off by far
    # more; ppo/grad_norm below catches one that clipping would rescale).
    grads = torch.load(tmp_path / "grads_0.pt")
    other_grads = torch.load(tmp_path / "grads_1.pt")
    assert len(grads) == len(other_grads) == len(single_grads) == 2
    assert all(torch.equal(a, b) for a, b in zip(grads, other_grads, strict=True))
    for step, (got, want) in enumerate(zip(grads, single_grads, strict=True)):
        assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item(), msg=f"step {step}")

    stats = json.loads((tmp_path / "stats_0.json").read_text())
    other = json.loads((tmp_path / "stats_1.json").read_text())
    measured = ("timing/", "perf/")  # wall-clock, differs per process
    assert {k: v for k, v in stats.items() if not k.startswith(measured)} == {
        k: v for k, v in other.items() if not k.startswith(measured)
    }
    for key in ("ppo/loss", "ppo/clip_frac", "ppo/behav_imp_weight", "ppo/grad_norm"):
        assert stats[key] == pytest.approx(single_stats[key], rel=1e-4, abs=1e-6), key
    assert stats["ppo/behav_imp_weight_max"] == pytest.approx(
        single_stats["ppo/behav_imp_weight_max"]
    )
    assert (tmp_path / "ckpt" / "trainer_state.pt").exists()
