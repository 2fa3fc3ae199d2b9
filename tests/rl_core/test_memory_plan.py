"""Memory plans (rl_core/memory_plan.py): the trainer's step on fake tensors over a fake process
group counts what real tensors hold, shards 7B and 32B models as the arithmetic says, and shows
what chunked logprobs and activation checkpointing take off a step's peak."""

from __future__ import annotations

import multiprocessing

import pytest

from rl_core.memory_plan import QWEN2, MemoryPlan, plan_step, qwen2_config


def small_config():
    """A Qwen2 shape small enough to run for real here (vocabulary 2,048: the logits matter)."""
    from transformers import Qwen2Config

    from rl_core.attention import register_packed_attention

    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config._attn_implementation = register_packed_attention()
    return config


def _plans(queue, config: str, variants: list[dict]) -> None:
    model = small_config() if config == "small" else qwen2_config(config)
    queue.put([plan_step(model, **variant) for variant in variants])


def plans(config: str, *variants: dict) -> list[MemoryPlan]:
    """``plan_step`` of each variant, in a process of their own (a plan makes the process's
    default process group: none may exist beside it)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_plans, args=(queue, config, list(variants)))
    process.start()
    try:
        return queue.get(timeout=540)
    finally:
        process.join(60)


@pytest.mark.parametrize(
    "variant",
    [{}, {"chunked": False}, {"lora_rank": 4}],
    ids=["chunked logprobs", "whole logits", "lora"],
)
def test_a_plan_on_fake_tensors_counts_what_the_same_step_on_real_tensors_holds(variant):
    settings = {"world_size": 2, "tokens": 1024, "sequence_length": 256, "chunk_tokens": 128}
    settings.update(variant)
    fake, real = plans("small", settings, {**settings, "fake": False})
    assert fake.state == real.state > 0
    # Within a few kB: a real step makes a few scalar tensors a fake one does not.
    assert fake.peak == pytest.approx(real.peak, rel=0.005) and real.peak > 2 * real.state
    assert fake.by_kind.keys() == real.by_kind.keys()
    for kind, used in real.by_kind.items():
        assert fake.by_kind[kind] == pytest.approx(used, rel=0.01, abs=16384), kind


@pytest.mark.slow
@pytest.mark.parametrize("size", ["7b", "32b"])
def test_7b_and_32b_shard_over_8_ranks_as_the_arithmetic_says(size):
    # float32 master weights, float32 gradients, AdamW's two float32 moments: 16 bytes per
    # parameter, over 8 ranks (FSDP2 pads each shard a little).
    (got,) = plans(
        size, {"world_size": 8, "tokens": 2048, "sequence_length": 1024, "checkpointing": True}
    )
    config = QWEN2[size]
    assert got.parameters == pytest.approx({"7b": 7.62e9, "32b": 32.76e9}[size], rel=0.01), (
        config
    )  # the published sizes
    expected = 16 * got.parameters / 8
    assert got.state == pytest.approx(expected, rel=0.05)
    assert got.sharded_parameters == pytest.approx(4 * got.parameters / 8, rel=0.05)
    assert got.optimizer == pytest.approx(8 * got.parameters / 8, rel=0.05)
    assert got.peak > got.state  # plus what the step makes


@pytest.mark.slow
def test_chunked_logprobs_and_checkpointing_take_the_logits_and_activations_off_the_peak():
    settings = {"world_size": 8, "tokens": 8192, "sequence_length": 2048}
    whole, chunked, both = plans(
        "1.5b",
        {**settings, "chunked": False},
        settings,
        {**settings, "checkpointing": True},
    )
    vocab = QWEN2["1.5b"]["vocab_size"]
    # The whole-logits path holds at least the float32 [T, V] logits beside the activations.
    assert whole.peak - chunked.peak >= 4 * settings["tokens"] * vocab * 0.9
    assert both.peak < chunked.peak / 2
    assert whole.state == chunked.state == both.state


@pytest.mark.slow
def test_a_lora_plan_holds_gradients_and_moments_for_the_adapter_only():
    settings = {"world_size": 8, "tokens": 2048, "sequence_length": 1024, "checkpointing": True}
    full, lora = plans("7b", settings, {**settings, "lora_rank": 16})
    assert 0 < lora.trainable < full.parameters / 50
    assert lora.gradients == pytest.approx(4 * lora.trainable / 8, rel=0.05)
    assert lora.optimizer == pytest.approx(8 * lora.trainable / 8, rel=0.05)
    assert lora.peak < full.peak / 2


@pytest.mark.parametrize("size", ["7b", "32b"])
def test_sharded_loading_of_7b_and_32b_over_8_ranks_never_holds_more_than_the_shards(
    size, tmp_path
):
    """The trainer's own loader (rl_core.sharded_load) on a fake process group of 8: built on
    the meta device, sharded, storage for this rank's shards. Every tensor made on the CPU is
    tracked: the peak is the shards, an eighth of the model (filling them reads one parameter's
    rows at a time: tests/rl_core/test_sharded_load.py)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from rl_core.config import RunConfig
    from rl_core.memory_plan import fake_process_group
    from rl_core.sharded_load import build_on_meta, sharded_skeleton

    config = qwen2_config(size)
    config._attn_implementation = None  # the config file alone: no weights for this size here
    config.save_pretrained(tmp_path)
    cfg = RunConfig.from_dict({"base_model": str(tmp_path), "mode": "online", "train_workers": 8})
    with fake_process_group(8) as mesh:
        tracker = MemTracker()
        with tracker:
            model = build_on_meta(str(tmp_path), torch.float32, None)
            model, _ = sharded_skeleton(model, tmp_path, cfg, torch.device("cpu"), mesh=mesh)
        peak = {
            str(device): kinds["Total"]
            for device, kinds in tracker.get_tracker_snapshot("peak").items()
        }
        shards = sum(p.to_local().numel() * 4 for p in model.parameters())
        parameters = sum(p.numel() for p in model.parameters())
    assert parameters == pytest.approx({"7b": 7.62e9, "32b": 32.76e9}[size], rel=0.01)
    assert shards == pytest.approx(4 * parameters / 8, rel=0.01)
    # The whole float32 model would be 8 times that; the rotary buffers are a few kB.
    assert shards <= peak["cpu"] <= shards + (1 << 20), (peak, shards)
