"""Multi-agent runs (``roles``): one LoRA adapter per role on one base model. A role's
trajectories train its adapter alone, with advantages, loss normalisation and statistics of
its own; checkpoints hold each role's adapter and resume them all."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from rl_core import lora
from rl_core.advantages import token_advantages
from rl_core.export import export_checkpoint
from rl_core.packing import pack, packed_logprobs
from rl_core.trainer import PPOTrainer
from tests.rl_core.test_trainer import _batch, _cfg, _on_policy

ROLES = ["speaker", "listener"]


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return str(tiny_model_dir)


def _roles_cfg(model_path, **overrides):
    settings = {"mode": "online", "lora_rank": 8, "lora_alpha": 16.0, "roles": ROLES}
    return _cfg(model_path, **{**settings, **overrides})


def _role_batch(trainer, role, seed=0, rewards=(1.0, 0.0, 1.0, 0.0), length=6):
    """Trajectories of ``role``, their behaviour logprobs its adapter's current ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with lora.active_adapter(trainer.model, role):
        for i, reward in enumerate(rewards):
            ids = torch.randint(0, 256, (length + 3 * i,), generator=g).tolist()
            traj = _on_policy(trainer, ids, 3, reward=reward, group_id=str(i // 2))
            traj.role = role
            out.append(traj)
    return out


def _adapter(trainer, role):
    """``role``'s adapter parameters by name, cloned."""
    return {
        name: p.detach().clone()
        for name, p in trainer.model.named_parameters()
        if lora.adapter_of(name) == role
    }


def _base(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" not in n}


def _changed(before, after):
    """Names whose values moved by more than float noise."""
    return {k for k in before if (before[k] - after[k]).abs().max().item() > 1e-4}


def _logprobs(trainer, role, batch):
    with torch.no_grad(), lora.active_adapter(trainer.model, role):
        return packed_logprobs(trainer.model, pack(batch))[0]


def test_each_role_has_its_own_trainable_adapter_held_by_the_optimizer(model_path):
    trainer = PPOTrainer(_roles_cfg(model_path))
    speaker, listener = _adapter(trainer, "speaker"), _adapter(trainer, "listener")
    assert speaker and listener and len(speaker) == len(listener)
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert held == trainable
    assert {id(p) for p in trainer.role_params["speaker"]} | {
        id(p) for p in trainer.role_params["listener"]
    } == trainable


def test_only_the_speakers_adapter_changes_when_only_speakers_trajectories_train(model_path):
    # Weight decay and Adam's momentum from a first step would move a parameter that merely
    # had a zero gradient: the listener's must get none at all.
    trainer = PPOTrainer(_roles_cfg(model_path, weight_decay=0.1))
    trainer.train_step(_role_batch(trainer, "speaker") + _role_batch(trainer, "listener", seed=1))
    speaker, listener, base = (
        _adapter(trainer, "speaker"),
        _adapter(trainer, "listener"),
        _base(trainer),
    )

    stats = trainer.train_step(_role_batch(trainer, "speaker", seed=2))

    after = _adapter(trainer, "listener")
    assert all(torch.equal(listener[k], after[k]) for k in listener)
    assert all(
        torch.equal(v, p) for v, p in zip(base.values(), _base(trainer).values(), strict=True)
    )
    moved = _changed(speaker, _adapter(trainer, "speaker"))
    assert {k for k in speaker if "lora_B" in k} <= moved
    assert stats["roles/speaker/num_trajectories"] == 4.0
    assert not any(k.startswith("roles/listener/") for k in stats)


def test_both_adapters_change_when_both_roles_train_and_the_base_never_does(model_path):
    trainer = PPOTrainer(_roles_cfg(model_path))
    speaker, listener, base = (
        _adapter(trainer, "speaker"),
        _adapter(trainer, "listener"),
        _base(trainer),
    )
    batch = _role_batch(trainer, "speaker", rewards=(1.0, 0.0)) + _role_batch(
        trainer, "listener", seed=1
    )

    stats = trainer.train_step(batch)

    assert {k for k in speaker if "lora_B" in k} <= _changed(speaker, _adapter(trainer, "speaker"))
    assert {k for k in listener if "lora_B" in k} <= _changed(
        listener, _adapter(trainer, "listener")
    )
    assert all(
        torch.equal(v, p) for v, p in zip(base.values(), _base(trainer).values(), strict=True)
    )
    # The adapters now differ: each role answers with its own.
    probe = _role_batch(trainer, "speaker", seed=5)
    assert (
        _logprobs(trainer, "speaker", probe) - _logprobs(trainer, "listener", probe)
    ).abs().max() > 1e-3
    assert stats["roles/speaker/num_trajectories"] == 2.0
    assert stats["roles/listener/num_trajectories"] == 4.0
    assert stats["rollout/num_trajectories"] == 6.0
    for role in ROLES:
        for key in ("reward", "reward_std", "response_tokens", "staleness_max", "ppo/loss",
                    "ppo/grad_norm", "ppo/clip_frac", "ppo/approx_kl"):  # fmt: skip
            assert f"roles/{role}/{key}" in stats, key
    assert stats["roles/speaker/reward"] == 0.5 and stats["roles/listener/reward"] == 0.5


def test_each_roles_advantages_are_computed_among_its_own_trajectories(model_path):
    trainer = PPOTrainer(_roles_cfg(model_path))
    # Same group ids in both roles: pooled, the speaker's 1s and the listener's 0s would
    # share a baseline; per role every reward equals its role's baseline.
    speaker = _role_batch(trainer, "speaker", rewards=(1.0, 1.0, 1.0, 1.0))
    listener = _role_batch(trainer, "listener", seed=1, rewards=(0.0, 0.0, 0.0, 0.0))
    seen = []
    plan = trainer._plan
    trainer._plan = lambda batch, advantages: (
        seen.append((batch, advantages)) or plan(batch, advantages)
    )

    trainer.train_step(speaker + listener)

    method = trainer.cfg.resolved_advantage
    assert [b for b, _ in seen] == [speaker, listener]
    for (_, used), alone in zip(seen, (speaker, listener), strict=True):
        expected, _ = token_advantages(alone, method)
        for u, e in zip(used, expected, strict=True):
            assert_close(u, e)
    pooled, _ = token_advantages(speaker + listener, method)
    assert any(not torch.allclose(u, p) for u, p in zip(seen[0][1], pooled[:4], strict=True))


def test_a_roles_gradient_does_not_depend_on_the_other_roles_tokens(model_path):
    grads = []
    for listener_length in (None, 6, 30):
        trainer = PPOTrainer(_roles_cfg(model_path))
        speaker = trainer.role_params["speaker"]
        seen: list = []  # the speaker's gradients at each optimizer step that has them

        def record(*_, speaker=speaker, seen=seen):
            if speaker[0].grad is not None:
                seen.append([p.grad.detach().clone() for p in speaker])

        trainer.optimizer.register_step_pre_hook(record)
        batch = _role_batch(trainer, "speaker")
        if listener_length:
            batch += _role_batch(trainer, "listener", seed=1, length=listener_length)
        trainer.train_step(batch)
        assert len(seen) == 1
        grads.append(seen[0])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            assert_close(a, b)


def test_a_trajectory_of_an_unknown_role_is_refused(model_path):
    trainer = PPOTrainer(_roles_cfg(model_path))
    batch = _role_batch(trainer, "speaker")
    batch[1].role = "narrator"
    with pytest.raises(ValueError, match=r"unknown roles \['narrator'\].*'speaker', 'listener'"):
        trainer.train_step(batch)
    batch[1].role = ""  # a roles run's trajectory names its role
    with pytest.raises(ValueError, match=r"unknown roles \[''\]"):
        trainer.train_step(batch)
    assert trainer.version == 0


def test_each_roles_adapter_is_saved_alone_and_checkpoints_resume_every_role(model_path, tmp_path):
    cfg = _roles_cfg(model_path)
    trainer = PPOTrainer(cfg)
    trainer.train_step(_role_batch(trainer, "speaker") + _role_batch(trainer, "listener", seed=1))

    # A role's adapter: a standard peft LoRA directory naming the base model.
    for role in ROLES:
        out = trainer.save_adapter(tmp_path / f"adapter-{role}", role=role)
        assert lora.is_lora_checkpoint(out) and lora.adapter_base(out) == str(
            lora.Path(model_path).resolve()
        )
        assert all(
            ".lora_" in k and role not in k for k in load_file(f"{out}/{lora.ADAPTER_WEIGHTS}")
        )
    speaker = load_file(str(tmp_path / "adapter-speaker" / lora.ADAPTER_WEIGHTS))
    listener = load_file(str(tmp_path / "adapter-listener" / lora.ADAPTER_WEIGHTS))
    assert speaker.keys() == listener.keys()
    assert any(not torch.equal(speaker[k], listener[k]) for k in speaker)

    ckpt = trainer.save_checkpoint(tmp_path / "ckpt")
    assert sorted(lora.role_checkpoints(ckpt)) == sorted(ROLES)
    # No one model to export: a role's adapter is, merged into the base weights.
    with pytest.raises(ValueError, match="multi-agent checkpoint.*roles/<role>"):
        export_checkpoint(ckpt, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(
        export_checkpoint(lora.role_checkpoints(ckpt)["speaker"], tmp_path / "export"),
        dtype=torch.float32,
    )
    probe = _role_batch(trainer, "listener", seed=7)
    with torch.no_grad():
        merged = packed_logprobs(exported, pack(probe))[0]
    assert_close(merged, _logprobs(trainer, "speaker", probe), rtol=1e-4, atol=1e-4)
    resumed = PPOTrainer(cfg)
    resumed.load_checkpoint(ckpt)
    assert resumed.version == 1
    for role in ROLES:
        assert_close(_logprobs(resumed, role, probe), _logprobs(trainer, role, probe))
    # The optimizer resumes too: the next step is the one the original trainer takes.
    batch = _role_batch(trainer, "speaker", seed=3) + _role_batch(trainer, "listener", seed=4)
    trainer.train_step(batch)
    resumed.train_step(batch)
    for role in ROLES:
        assert_close(_logprobs(resumed, role, probe), _logprobs(trainer, role, probe))


def test_a_one_adapter_checkpoint_starts_every_role(model_path, tmp_path):
    single = PPOTrainer(_cfg(model_path, lora_rank=8, lora_alpha=16.0))
    single.train_step(_batch(single))
    ckpt = single.save_checkpoint(tmp_path / "single")

    trainer = PPOTrainer(_roles_cfg(model_path, init_checkpoint=ckpt))
    probe = _role_batch(trainer, "speaker", seed=7)
    expected = _logprobs(single, "", probe)
    for role in ROLES:
        assert_close(_logprobs(trainer, role, probe), expected)
