"""The trainer's memory settings: packed attention, precision, gradient checkpointing, peak memory."""

import math

import pytest
import torch
from torch.testing import assert_close

from rl_core.attention import PACKED_ATTENTION
from rl_core.config import RunConfig
from rl_core.memory import resolve_precision
from rl_core.trainer import PPOTrainer
from rl_core.types import Trajectory


def _cfg(model_path, **overrides):
    return RunConfig.from_dict(
        {
            "base_model": str(model_path),
            "reward": {"type": "exact_match"},
            "batch_size": 4,
            "group_size": 2,
            "learning_rate": 1e-3,
            "max_grad_norm": 0.0,
            **overrides,
        }
    )


def _batch():
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(4):
        n = 9 + 4 * i
        mask = [0] * 3 + [1] * (n - 3)
        behaviour = (-torch.rand(n, generator=g)).tolist()
        trajs.append(
            Trajectory(
                input_ids=torch.randint(0, 256, (n,), generator=g).tolist(),
                loss_mask=mask,
                logprobs=[lp * m for lp, m in zip(behaviour, mask, strict=True)],
                versions=[0 if m else -1 for m in mask],
                rewards=[float(i % 2)],
                group_id=str(i // 2),
            )
        )
    return trajs


def _grads_at_optimizer_step(trainer):
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.append([p.grad.detach().clone() for p in trainer.params])
    )
    return seen


def _checkpointing(model):
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _counting(forward, calls, name):
    def counted(*args, **kwargs):
        calls[name] += 1
        return forward(*args, **kwargs)

    return counted


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [
        ("auto", "cuda", "bf16"),
        ("auto", "cpu", "fp32"),
        ("fp32", "cuda", "fp32"),
        ("bf16", "cpu", "bf16"),
        ("bf16", "cuda", "bf16"),
    ],
)
def test_precision_resolves_per_device(setting, device, expected):
    assert resolve_precision(setting, torch.device(device)) == expected


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="use auto, fp32 or bf16"):
        resolve_precision("fp16", torch.device("cpu"))


def test_trainer_and_reference_models_use_packed_attention_and_fp32_on_cpu(tiny_model_dir):
    trainer = PPOTrainer(_cfg(tiny_model_dir, kl_coef=0.1), device="cpu")
    assert trainer.precision == "fp32" and trainer.autocast_dtype is None
    assert trainer.model.config._attn_implementation == PACKED_ATTENTION
    assert trainer.ref_model.config._attn_implementation == PACKED_ATTENTION
    stats = trainer.train_step(_batch())
    assert math.isfinite(stats["ppo/kl_ref"])


def test_bf16_precision_computes_in_bf16_and_keeps_float32_weights(tiny_model_dir):
    trainer = PPOTrainer(_cfg(tiny_model_dir, precision="bf16"), device="cpu")
    assert trainer.precision == "bf16"
    seen = []
    trainer.model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    stats = trainer.train_step(_batch())
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    assert math.isfinite(stats["ppo/loss"])


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(tiny_model_dir):
    plain = PPOTrainer(_cfg(tiny_model_dir), device="cpu")
    ckpt = PPOTrainer(_cfg(tiny_model_dir, gradient_checkpointing=True), device="cpu")
    assert _checkpointing(ckpt.model) and not _checkpointing(plain.model)
    calls = {"plain": 0, "ckpt": 0}
    for name, trainer in (("plain", plain), ("ckpt", ckpt)):
        # Wrap forward itself: torch runs no module hooks while it recomputes a checkpoint.
        mlp = trainer.model.model.layers[0].mlp
        mlp.forward = _counting(mlp.forward, calls, name)
    g_plain, g_ckpt = _grads_at_optimizer_step(plain), _grads_at_optimizer_step(ckpt)
    batch = _batch()
    plain.train_step(batch)
    ckpt.train_step(batch)
    # Checkpointing runs each layer's forward again in the backward pass.
    assert calls["ckpt"] > calls["plain"]
    names = [n for n, p in plain.model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, g_plain[0], g_ckpt[0], strict=True):
        assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_peak_memory_is_reported_per_step(tiny_model_dir):
    trainer = PPOTrainer(_cfg(tiny_model_dir), device="cpu")
    stats = trainer.train_step(_batch())
    # The process holds at least torch and the model: tens of MB, and well under a terabyte.
    assert 0.01 < stats["perf/peak_memory_gb"] < 1000
