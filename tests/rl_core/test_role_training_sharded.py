"""Multi-agent runs (``roles``) on two gloo trainer ranks (FSDP2): each role's adapter trains
from its own trajectories only, and its saved adapter and checkpoint hold what the shards hold."""

import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from rl_core import lora
from rl_core.config import RunConfig
from rl_core.distributed import full_model_state
from rl_core.trainer import PPOTrainer
from rl_core.types import Trajectory

WORLD_SIZE = 2
ROLES = ["speaker", "listener"]


def _cfg(path):
    return RunConfig.from_dict(
        {
            "base_model": str(path),
            "mode": "online",
            "lora_rank": 4,
            "lora_alpha": 8.0,
            "roles": ROLES,
            "train_workers": 2,
            "learning_rate": 1e-2,
            "batch_size": 4,
        }
    )


def _trajectories(role, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, reward in enumerate((1.0, 0.0, 1.0, 0.0)):
        ids = torch.randint(0, 256, (7 + 2 * i,), generator=g).tolist()
        mask = [0] * 3 + [1] * (len(ids) - 3)
        logprobs = [-5.0 * m for m in mask]  # behaviour logprobs: any, the step is off-policy
        versions = [0 if m else -1 for m in mask]
        out.append(Trajectory(ids, mask, logprobs, versions, [reward], str(i // 2), role=role))
    return out


def _worker(rank, store, out, path):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    try:
        cfg = _cfg(path)
        trainer = PPOTrainer(cfg, device="cpu")
        assert trainer.fsdp
        states = [full_model_state(trainer.model, trainable_only=True)]
        trainer.train_step(_trajectories("speaker", 0) + _trajectories("listener", 1))
        states.append(full_model_state(trainer.model, trainable_only=True))
        trainer.train_step(_trajectories("speaker", 2))
        states.append(full_model_state(trainer.model, trainable_only=True))
        trainer.save_adapter(f"{out}/speaker", role="speaker")
        trainer.save_checkpoint(f"{out}/ckpt")
        resumed = PPOTrainer(cfg, device="cpu")
        resumed.load_checkpoint(f"{out}/ckpt")
        states.append(full_model_state(resumed.model, trainable_only=True))
        if rank == 0:
            torch.save(states, f"{out}/states.pt")
    finally:
        dist.destroy_process_group()


def test_two_sharded_ranks_train_each_role_from_its_own_trajectories_and_resume_them(
    tiny_model_dir, tmp_path
):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path), str(tiny_model_dir)), nprocs=2)
    start, both, speaker_only, resumed = torch.load(tmp_path / "states.pt")

    def of(state, role, part="lora_B"):
        return {k: v for k, v in state.items() if lora.adapter_of(k) == role and part in k}

    for role in ROLES:  # both roles trained in the first step
        assert all((of(both, role)[k] - v).abs().max() > 1e-4 for k, v in of(start, role).items())
    # The second step had only the speaker's trajectories: the listener's adapter is untouched.
    assert all(torch.equal(of(speaker_only, "listener", "")[k], v)
               for k, v in of(both, "listener", "").items())  # fmt: skip
    assert all((of(speaker_only, "speaker")[k] - v).abs().max() > 1e-4
               for k, v in of(both, "speaker").items())  # fmt: skip
    assert resumed.keys() == speaker_only.keys()
    assert all(torch.equal(resumed[k], v) for k, v in speaker_only.items())
    # The speaker's adapter as saved for the servers: the shards' values, in peft's format.
    saved = load_file(str(tmp_path / "speaker" / lora.ADAPTER_WEIGHTS))
    mine = of(speaker_only, "speaker", "")
    assert len(saved) == len(mine)
    for key, value in mine.items():
        assert torch.equal(saved[key.replace(".speaker.", ".")], value)
    assert sorted(lora.role_checkpoints(tmp_path / "ckpt")) == sorted(ROLES)
