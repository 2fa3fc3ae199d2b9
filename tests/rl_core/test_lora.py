"""LoRA runs (``lora_rank > 0``): only the adapter trains, checkpoints hold the adapter only
and resume exactly, inference servers and exports get the merged weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from rl_core import lora
from rl_core.export import export_checkpoint
from rl_core.packing import pack, packed_logprobs
from rl_core.trainer import PPOTrainer
from rl_core.trainer_saving import TRAINER_STATE
from tests.rl_core.test_trainer import _batch, _cfg, _grads_at_optimizer_step


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return str(tiny_model_dir)


def _lora_cfg(model_path, **overrides):
    return _cfg(model_path, **{"lora_rank": 8, "lora_alpha": 16.0, **overrides})


def _split(trainer):
    """``(adapter, base)`` parameters by name, cloned."""
    adapter, base = {}, {}
    for name, p in trainer.model.named_parameters():
        (adapter if p.requires_grad else base)[name] = p.detach().clone()
    return adapter, base


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]  # [T, V]


IDS = [5, 17, 99, 3, 250, 42, 7, 7, 128]


def test_only_the_adapter_trains_and_the_base_weights_stay_bit_identical(model_path):
    trainer = PPOTrainer(_lora_cfg(model_path))
    adapter, base = _split(trainer)
    assert adapter and all(".lora_" in name for name in adapter)
    # The optimizer holds the adapter and nothing else.
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainer.params) < 0.2 * sum(
        p.numel() for p in trainer.model.parameters()
    )

    trainer.train_step(_batch(trainer))
    adapter_after, base_after = _split(trainer)
    assert all(torch.equal(base[k], base_after[k]) for k in base)
    # lora_B starts at zero and every B gets a gradient; A only moves once B is non-zero.
    assert all(not torch.equal(adapter[k], adapter_after[k]) for k in adapter if "lora_B" in k)


def test_the_kl_reference_is_the_base_model_with_the_adapter_off(model_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trainer = PPOTrainer(_lora_cfg(model_path, kl_coef=0.1, ppo_minibatches=2))
    assert trainer.ref_model is None  # no second copy of the weights
    stats = trainer.train_step(_batch(trainer))
    # The first minibatch starts at the base model (B = 0); the second has moved away.
    assert stats["ppo/kl_ref"] > 0

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = pack(_batch(trainer, seed=3))
    with torch.no_grad(), lora.reference(trainer.model, trainer.ref_model) as ref:
        ref_logprobs, _ = packed_logprobs(ref, batch)
    with torch.no_grad():
        base_logprobs, _ = packed_logprobs(base, batch)
        trained_logprobs, _ = packed_logprobs(trainer.model, batch)
    assert_close(ref_logprobs, base_logprobs, rtol=0, atol=1e-5)
    assert (trained_logprobs - base_logprobs).abs().max() > 1e-3  # the adapter is back on


def test_a_lora_checkpoint_holds_the_adapter_only_and_resumes_exactly(model_path, tmp_path):
    cfg = _lora_cfg(model_path, lr_schedule="cosine", lr_warmup_steps=1, learning_rate=1e-3)
    first = PPOTrainer(cfg)
    first.train_step(_batch(first, seed=1))
    first.save_checkpoint(tmp_path / "ckpt")
    files = {f.name for f in (tmp_path / "ckpt").iterdir()}
    assert {lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG, TRAINER_STATE, "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    saved = load_file(str(tmp_path / "ckpt" / lora.ADAPTER_WEIGHTS))
    assert all(".lora_" in k for k in saved)
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in first.params)
    assert lora.adapter_base(tmp_path / "ckpt") == str(Path(model_path).resolve())

    next_batch = _batch(first, seed=2)
    seen_first = _grads_at_optimizer_step(first)
    expected = first.train_step(next_batch)
    resumed = PPOTrainer(cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.version == 1
    seen_resumed = _grads_at_optimizer_step(resumed)
    got = resumed.train_step(next_batch)

    assert got["ppo/lr"] == expected["ppo/lr"]
    assert got["ppo/loss"] == pytest.approx(expected["ppo/loss"], rel=1e-6, abs=1e-9)
    for a, b in zip(seen_first[0], seen_resumed[0], strict=True):
        assert_close(b, a, rtol=1e-5, atol=1e-7)
    # With the optimizer state restored, Adam's step is smooth in the gradient: any
    # float-noise difference stays far below one learning-rate-sized update (1e-3).
    (a_first, b_first), (a_resumed, b_resumed) = _split(first), _split(resumed)
    for k in a_first:
        assert_close(a_resumed[k], a_first[k], rtol=0, atol=1e-6, msg=k)
    assert all(torch.equal(b_first[k], b_resumed[k]) for k in b_first)


def test_checkpoints_refuse_the_other_kind_of_run(model_path, tmp_path):
    lora_run = PPOTrainer(_lora_cfg(model_path))
    lora_run.save_checkpoint(tmp_path / "lora")
    full_run = PPOTrainer(_cfg(model_path))
    full_run.save_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match="LoRA checkpoint"):
        full_run.load_checkpoint(tmp_path / "lora")
    with pytest.raises(FileNotFoundError, match="holds no LoRA adapter"):
        lora_run.load_checkpoint(tmp_path / "full")
    other_rank = PPOTrainer(_cfg(model_path, lora_rank=4))
    with pytest.raises(ValueError, match="does not fit"):
        other_rank.load_checkpoint(tmp_path / "lora")


def test_saved_weights_are_the_merged_model_and_the_training_model_is_untouched(
    model_path, tmp_path
):
    from transformers import AutoModelForCausalLM

    trainer = PPOTrainer(_lora_cfg(model_path))
    trainer.train_step(_batch(trainer))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    expected = _logits(trainer.model, IDS)
    out = trainer.save_weights(tmp_path / "weights")
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert_close(_logits(trainer.model, IDS), expected, rtol=0, atol=0)

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in k or "base_layer" in k for k in loaded.state_dict())
    assert_close(_logits(loaded, IDS), expected, rtol=0, atol=1e-4)


def test_merge_adds_scale_times_b_a_to_each_adapted_weight(model_path):
    trainer = PPOTrainer(_lora_cfg(model_path, lora_target_modules=["q_proj"], lora_alpha=4.0))
    layer = trainer.model.get_base_model().model.layers[0].self_attn.q_proj
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.params:
            p.copy_(torch.randn(p.shape, generator=gen))
    state = lora.merged_state_dict(trainer.model, torch.float32)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # [r, in], [out, r]
    w = layer.base_layer.weight  # [out, in]
    # alpha / r = 4 / 8
    assert_close(state["model.layers.0.self_attn.q_proj.weight"], w + 0.5 * b @ a)
    assert torch.equal(
        state["model.layers.0.self_attn.k_proj.weight"],
        trainer.model.get_base_model().model.layers[0].self_attn.k_proj.weight,
    )
    assert not any("lora" in k or "base_layer" in k for k in state)


def test_init_checkpoint_from_a_lora_checkpoint_is_base_weights_plus_that_adapter(
    model_path, tmp_path
):
    first = PPOTrainer(_lora_cfg(model_path))
    first.train_step(_batch(first, seed=1))
    first.save_checkpoint(tmp_path / "ckpt")
    expected = _logits(first.model, IDS)

    lora_clone = PPOTrainer(_lora_cfg(model_path, init_checkpoint=str(tmp_path / "ckpt")))
    assert lora_clone.version == 0 and not lora_clone.optimizer.state
    assert_close(_logits(lora_clone.model, IDS), expected, rtol=0, atol=0)
    lora_clone.train_step(_batch(lora_clone, seed=2))

    full_clone = PPOTrainer(_cfg(model_path, init_checkpoint=str(tmp_path / "ckpt"), kl_coef=0.1))
    assert not hasattr(full_clone.model, "peft_config")
    assert_close(_logits(full_clone.model, IDS), expected, rtol=0, atol=1e-4)
    assert_close(_logits(full_clone.ref_model, IDS), expected, rtol=0, atol=1e-4)
    full_clone.train_step(_batch(full_clone, seed=2))


def test_the_export_of_a_lora_checkpoint_loads_in_transformers_with_base_plus_adapter_logits(
    model_path, tiny_model_dir, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = PPOTrainer(_lora_cfg(model_path))
    trainer.train_step(_batch(trainer))
    trainer.save_checkpoint(tmp_path / "ckpt")

    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.float32  # the tiny base model's dtype
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "ckpt")).eval()
    assert_close(_logits(exported, IDS), _logits(with_adapter, IDS), rtol=0, atol=1e-4)
    assert AutoTokenizer.from_pretrained(out).decode([104, 105]) == "hi"
    assert not (tmp_path / "export.tmp").exists()


def test_the_export_of_a_full_checkpoint_is_cast_to_the_base_models_dtype(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    bf16_dir = tmp_path / "bf16-base"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(
        bf16_dir
    )
    for f in tiny_model_dir.glob("tokenizer*"):
        shutil.copy2(f, bf16_dir / f.name)
    trainer = PPOTrainer(_cfg(str(bf16_dir)))
    trainer.train_step(_batch(trainer))
    trainer.save_checkpoint(tmp_path / "ckpt")  # float32

    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.bfloat16
    for (k, a), b in zip(
        trainer.model.state_dict().items(), exported.state_dict().values(), strict=True
    ):
        assert torch.equal(a.to(torch.bfloat16), b), k
