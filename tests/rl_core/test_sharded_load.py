"""Sharded loading (rl_core.sharded_load): two gloo ranks fill their FSDP2 shards from the files
and end with the parameters the unsharded path loads, without either rank holding the model."""

import datetime
import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rl_core import lora
from rl_core.config import RunConfig
from rl_core.distributed import full_model_state, shard_model
from rl_core.memory import PeakMemory
from rl_core.sharded_load import load_sharded
from rl_core.types import Trajectory

WORLD_SIZE = 2
CPU = torch.device("cpu")


def _cfg(path, lora_rank=0):
    return RunConfig.from_dict(
        {"base_model": str(path), "mode": "online", "lora_rank": lora_rank, "train_workers": 2}
    )


def _join(rank, store):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)


def _equal_worker(rank, store, out, cases):
    """For each (path, lora_rank): the unsharded path's state, then the sharded one's, from the
    same seed (a fresh adapter's random initialisation must match too)."""
    _join(rank, store)
    try:
        results = {}
        for name, (path, lora_rank) in cases.items():
            cfg = _cfg(path, lora_rank)
            torch.manual_seed(cfg.seed)
            whole = lora.load_policy(path, cfg, torch.float32, CPU)
            shard_model(whole)
            torch.manual_seed(cfg.seed)
            sharded = load_sharded(path, cfg, torch.float32, CPU)
            ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
            with torch.no_grad():
                logits = (whole(ids).logits, sharded(ids).logits)
            results[name] = (full_model_state(whole), full_model_state(sharded), logits)
            buffers = (dict(whole.named_buffers()), dict(sharded.named_buffers()))
            assert buffers[0].keys() == buffers[1].keys()
            assert all(torch.equal(buffers[0][k], buffers[1][k]) for k in buffers[0])
        if rank == 0:
            torch.save(results, f"{out}/states.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_model_dir, tmp_path_factory):
    """A LoRA checkpoint of the tiny model whose adapter is not zero (B random)."""
    cfg = _cfg(tiny_model_dir, lora_rank=4)
    model = lora.load_policy(tiny_model_dir, cfg, torch.float32, CPU)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    out = tmp_path_factory.mktemp("lora-ckpt")
    lora.save_adapter(model, out)
    return out


def test_sharded_loading_gives_the_unsharded_parameters_full_lora_and_from_checkpoints(
    tiny_model_dir, lora_checkpoint, tmp_path
):
    cases = {
        "full": (str(tiny_model_dir), 0),
        "lora": (str(tiny_model_dir), 4),
        # A LoRA run continuing a LoRA checkpoint's adapter; a full run from its merged weights.
        "lora_from_lora": (str(lora_checkpoint), 4),
        "full_from_lora": (str(lora_checkpoint), 0),
    }
    mp.spawn(_equal_worker, args=(str(tmp_path / "store"), str(tmp_path), cases), nprocs=WORLD_SIZE)
    results = torch.load(tmp_path / "states.pt")
    for name, (whole, sharded, (want, got)) in results.items():
        assert whole.keys() == sharded.keys(), name
        lora_keys = [k for k in whole if ".lora_" in k]
        assert bool(lora_keys) == (cases[name][1] > 0), name
        for key in whole:
            if name == "full_from_lora":  # the merge's sum is taken row block by row block
                assert_close(sharded[key], whole[key], rtol=1e-6, atol=1e-7, msg=key)
            else:
                assert torch.equal(sharded[key], whole[key]), (name, key)
        assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The checkpoint's adapter was loaded (not a fresh one), and merged where the run is full.
    with_adapter = results["lora_from_lora"][1]
    fresh = results["lora"][1]
    b_keys = [k for k in fresh if "lora_B" in k]
    assert all(torch.count_nonzero(fresh[k]) == 0 for k in b_keys)
    assert all(torch.count_nonzero(with_adapter[k]) > 0 for k in b_keys)
    base = results["full"][1]
    merged = results["full_from_lora"][1]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(merged[norm], base[norm])


@pytest.fixture(scope="module")
def wide_model_dir(tiny_model_dir, tmp_path_factory):
    """A bf16 Llama of 43M parameters (171 MB in float32), tied embeddings: big enough that a
    rank holding it whole is told from one holding half of it, with many small parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("wide-model")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a trainer needs one (unused)
        shutil.copy2(tiny_model_dir / name, out / name)
    return out


def _memory_worker(rank, store, out, path, sharded):
    _join(rank, store)
    try:
        cfg = _cfg(path)
        # Imports and the model's modules loaded first: the meter sees the weights alone.
        import peft  # noqa: F401
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        memory = PeakMemory(CPU).start()
        if sharded:
            model = load_sharded(path, cfg, torch.float32, CPU)
        else:
            model = lora.load_policy(path, cfg, torch.float32, CPU)
            shard_model(model)
        grown = memory.peak_gb() - memory.start_gb
        dist.barrier()
        local = sum(p.to_local().numel() * 4 for p in model.parameters()) / 1e9
        with open(f"{out}/memory_{int(sharded)}_{rank}.json", "w") as f:
            json.dump({"peak_growth_gb": grown, "local_gb": local}, f)
    finally:
        dist.destroy_process_group()


def test_no_rank_holds_the_whole_model_while_loading_sharded(wide_model_dir, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(wide_model_dir)
    whole_gb = (
        4
        * (
            config.vocab_size * config.hidden_size
            + config.num_hidden_layers
            * (4 * config.hidden_size**2 + 3 * config.hidden_size * config.intermediate_size)
        )
        / 1e9
    )  # float32; norms aside
    growth = {}
    for sharded in (True, False):
        store = tmp_path / f"store-{sharded}"
        mp.spawn(
            _memory_worker,
            args=(str(store), str(tmp_path), str(wide_model_dir), sharded),
            nprocs=WORLD_SIZE,
        )
        for rank in range(WORLD_SIZE):
            result = json.loads((tmp_path / f"memory_{int(sharded)}_{rank}.json").read_text())
            assert result["local_gb"] == pytest.approx(whole_gb / 2, rel=0.01)
            growth[sharded, rank] = result["peak_growth_gb"]
    # The unsharded path holds the whole model on each rank (the meter can tell)...
    assert all(growth[False, rank] > 0.95 * whole_gb for rank in range(WORLD_SIZE)), growth
    # ...sharded loading its half plus a parameter's rows.
    assert all(growth[True, rank] < 0.75 * whole_gb for rank in range(WORLD_SIZE)), growth


def _saving_worker(rank, store, out, path):
    from rl_core import streamed_weights
    from rl_core.trainer import PPOTrainer

    _join(rank, store)
    try:
        trainer = PPOTrainer(_cfg(path), device="cpu")
        assert trainer.fsdp
        # One step first: AdamW's moments exist (a checkpoint saves them, not creates them).
        mask = [0, 0] + [1] * 10
        versions = [0 if m else -1 for m in mask]
        # Two answers with opposite advantages; behaviour logprobs near the untrained model's
        # own (about -log 8192).
        batch = [
            Trajectory(list(range(start, start + 12)), mask, [-9.0] * 12, versions, [reward])
            for start, reward in ((5, 0.0), (40, 1.0))
        ]
        trainer.train_step(batch)
        streamed_weights.FILE_BYTES = 8 << 20  # files of 8 MiB: a rank holds one at a time
        growth = {}
        for what, save in (
            ("weights", trainer.save_weights),
            ("checkpoint", trainer.save_checkpoint),
        ):
            memory = PeakMemory(CPU).start()
            save(f"{out}/{what}")
            growth[what] = memory.peak_gb() - memory.start_gb
        with open(f"{out}/saving_{rank}.json", "w") as f:
            json.dump(growth, f)
    finally:
        dist.destroy_process_group()


def test_saving_weights_and_checkpoints_never_gathers_the_model(wide_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    mp.spawn(
        _saving_worker,
        args=(str(tmp_path / "store"), str(tmp_path), str(wide_model_dir)),
        nprocs=WORLD_SIZE,
    )
    model = AutoModelForCausalLM.from_pretrained(wide_model_dir, dtype=torch.float32)
    whole_gb = sum(p.numel() for p in model.parameters()) * 4 / 1e9
    for rank in range(WORLD_SIZE):
        growth = json.loads((tmp_path / f"saving_{rank}.json").read_text())
        # At most a file of tensors, one gathered tensor and the write's buffers (before: the
        # whole float32 model on rank 0, then its bf16 copy).
        assert growth["weights"] < 0.3 * whole_gb, growth
        assert growth["checkpoint"] < 0.3 * whole_gb, growth
    # What was written is the trained model: float32 in the checkpoint, bf16 for servers.
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32)
    assert not torch.equal(trained.model.norm.weight, model.model.norm.weight)
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "weights", dtype=torch.bfloat16)
    want = trained.to(torch.bfloat16).state_dict()
    got = served.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for what in ("weights", "checkpoint"):
        assert len(list((tmp_path / what).glob("model-*.safetensors"))) > 4
