"""The memory settings a single-GPU team needs: ``cpu_offload`` (FSDP2's CPU offload, also for one
trainer worker) and ``activation_offload`` (saved activations in CPU memory). On a CPU they move
nothing, but the step they take must be the step taken without them."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rl_core.config import RunConfig
from rl_core.packing import pack, packed_logprobs
from rl_core.trainer import PPOTrainer
from rl_core.types import Trajectory


def _cfg(model_path, **settings):
    return RunConfig.from_dict(
        {
            "base_model": str(model_path),
            "mode": "online",
            "batch_size": 4,
            "ppo_minibatches": 2,
            "learning_rate": 1e-4,
            "micro_batch_tokens": 32,
            **settings,
        }
    )


def _batch(model_path):
    trainer = PPOTrainer(_cfg(model_path), device="cpu")
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i, length in enumerate((9, 12, 14, 17)):
        ids = torch.randint(0, 256, (length,), generator=g).tolist()
        mask = [0, 0] + [1] * (length - 2)
        traj = Trajectory(ids, mask, [0.0] * length, [0 if m else -1 for m in mask], [float(i)])
        with torch.no_grad():
            logprobs, _ = packed_logprobs(trainer.model, pack([traj]))
        traj.logprobs = [(lp - 0.03 * i) * m for lp, m in zip(logprobs.tolist(), mask, strict=True)]
        trajs.append(traj)
    return trajs


def _grads_at_steps(trainer):
    seen = []

    def full(g):
        return g.full_tensor() if hasattr(g, "full_tensor") else g

    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.append(torch.cat([full(p.grad).reshape(-1) for p in trainer.params]))
    )
    return seen


def _worker(rank, world, store, out, model_path, batch, offload):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        trainer = PPOTrainer(
            _cfg(model_path, train_workers=world, cpu_offload=offload), device="cpu"
        )
        assert trainer.fsdp
        param_group = trainer.model._get_fsdp_state()._fsdp_param_group
        offloaded = all(p.offload_to_cpu for p in param_group.fsdp_params)
        grads = _grads_at_steps(trainer)
        stats = trainer.train_step(batch)
        if rank == 0:
            torch.save(
                {"grads": grads, "loss": stats["ppo/loss"], "offloaded": offloaded},
                f"{out}/result.pt",
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, name, world, model_path, batch, offload):
    out = tmp_path / name
    out.mkdir()
    mp.spawn(
        _worker,
        args=(world, str(out / "store"), str(out), str(model_path), batch, offload),
        nprocs=world,
    )
    return torch.load(out / "result.pt")


def test_cpu_offload_takes_the_same_step_on_two_workers_and_on_a_group_of_one(
    tiny_model_dir, tmp_path
):
    batch = _batch(tiny_model_dir)
    plain = _run(tmp_path, "plain", 2, tiny_model_dir, batch, offload=False)
    offloaded = _run(tmp_path, "offload", 2, tiny_model_dir, batch, offload=True)
    alone = _run(tmp_path, "alone", 1, tiny_model_dir, batch, offload=True)
    assert (plain["offloaded"], offloaded["offloaded"], alone["offloaded"]) == (False, True, True)

    single = PPOTrainer(_cfg(tiny_model_dir), device="cpu")
    assert not single.fsdp
    single_grads = _grads_at_steps(single)
    single_loss = single.train_step(batch)["ppo/loss"]
    assert len(single_grads) == 2
    # The same gradients at each of the step's two optimizer steps (the ranks sum in another
    # order than one process: float32 noise of the largest gradient).
    for got in (plain, offloaded, alone):
        assert len(got["grads"]) == 2
        for g, want in zip(got["grads"], single_grads, strict=True):
            assert_close(g, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
        assert got["loss"] == pytest.approx(single_loss, rel=1e-4, abs=1e-6)
    # Offloading moves where the state lives, not what is computed.
    for a, b in zip(offloaded["grads"], plain["grads"], strict=True):
        assert torch.equal(a, b)


def test_cpu_offload_without_torch_distributed_is_refused_clearly(tiny_model_dir):
    with pytest.raises(ValueError, match="cpu_offload shards the trainer with FSDP2"):
        PPOTrainer(_cfg(tiny_model_dir, cpu_offload=True), device="cpu")


def test_activation_offload_packs_the_saved_activations_and_takes_the_same_step(
    tiny_model_dir, monkeypatch
):
    batch = _batch(tiny_model_dir)
    plain = PPOTrainer(_cfg(tiny_model_dir), device="cpu")
    plain_grads = _grads_at_steps(plain)
    plain.train_step(batch)

    packed = []
    original = torch.autograd.graph.save_on_cpu

    class Counting(original):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory=pin_memory, device_type=device_type)
            pack_hook = self.pack_hook

            def counted(tensor):
                packed.append(tensor.numel())
                return pack_hook(tensor)

            self.pack_hook = counted

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    offloaded = PPOTrainer(_cfg(tiny_model_dir, activation_offload=True), device="cpu")
    grads = _grads_at_steps(offloaded)
    offloaded.train_step(batch)

    assert len(packed) > 50  # every saved activation of both micro-batches' forwards
    assert len(grads) == len(plain_grads) == 2
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
