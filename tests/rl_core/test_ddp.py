"""Data parallel training: two CPU processes (gloo) take the step one process takes on the whole batch."""

import copy
import datetime
import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rl_core import streamed_weights
from rl_core.config import RunConfig
from rl_core.distributed import full_optimizer_state, optimizer_state_by_name
from rl_core.export import export_checkpoint
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


def _batch(trainer, lengths=(5, 7, 9, 11, 13)):
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, 256, (length,), generator=g).tolist()
        mask = [0, 0] + [1] * (len(ids) - 2)
        traj = Trajectory(ids, mask, [0.0] * len(ids), [0 if m else -1 for m in mask], [float(i)])
        # Each sequence sampled at its own temperature: ranks and micro-batches mix them.
        traj.temperatures = [1.0] * 2 + [0.6 + 0.2 * i] * (len(ids) - 2)
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
    # Recomputed at each token's temperature, the only gap is _batch's offset of 0.05 * i.
    assert stats["ppo/behav_imp_weight_max"] == pytest.approx(math.exp(0.05 * 4), rel=1e-3)
    assert (tmp_path / "ckpt" / "trainer_state.pt").exists()


# --------------------------------------------------------------------------- FSDP2


def _fsdp_cfg(model_path, train_workers):
    return RunConfig.from_dict(
        {**_cfg(model_path).to_dict(), "train_workers": train_workers, "micro_batch_tokens": 16}
    )


def _count_micro_batches(trainer):
    """Micro-batch losses this rank computed: (all, padding ones with nothing to train)."""
    counts = {"all": 0, "padding": 0}
    compute = trainer._micro_batch_loss

    def counted(mb, normalizer):
        counts["all"] += 1
        counts["padding"] += int(not mb.loss_mask.any())
        return compute(mb, normalizer)

    trainer._micro_batch_loss = counted
    return counts


def _full_grads_at_optimizer_steps(trainer):
    """Like ``_grads_at_optimizer_steps``, the sharded (DTensor) gradients gathered whole."""
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.append(
            torch.cat([p.grad.full_tensor().reshape(-1) for p in trainer.params])
        )
    )
    return seen


def _sorted_flat(state):
    return torch.cat([state[k].reshape(-1) for k in sorted(state)])


def _full_params(trainer):
    from rl_core.distributed import full_model_state

    state = full_model_state(trainer.model)  # a collective: every rank calls it
    return torch.cat([state[k].reshape(-1) for k in sorted(state)]) if state else None


def _fsdp_worker(rank, model_path, store, out_dir):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        trainer = PPOTrainer(_fsdp_cfg(model_path, WORLD_SIZE), device="cpu")
        assert trainer.fsdp
        counts = _count_micro_batches(trainer)
        grads = _full_grads_at_optimizer_steps(trainer)
        batch = _batch_for(model_path)
        stats = trainer.train_step(batch)
        # Files of 40 kB at most (the tiny model is 150 kB): both ranks write some.
        streamed_weights.FILE_BYTES = 40_000
        trainer.save_weights(f"{out_dir}/weights")
        trainer.save_checkpoint(f"{out_dir}/ckpt")
        after_one = _full_params(trainer)
        # (Deep-copied: the gathered state shares the scalar ``step`` tensors with the optimizer.)
        optimizer_one = copy.deepcopy(full_optimizer_state(trainer.model, trainer.optimizer))
        trainer.train_step(batch)
        after_two = _full_params(trainer)
        trainer.load_checkpoint(f"{out_dir}/ckpt")
        resumed_version = trainer.version
        resumed = _full_params(trainer)
        trainer.train_step(batch)
        again = _full_params(trainer)
        if rank == 0:
            torch.save(
                {
                    "grads": grads[:2],
                    "after_one": after_one,
                    "after_two": after_two,
                    "resumed": resumed,
                    "again": again,
                    "resumed_version": resumed_version,
                    "optimizer_one": optimizer_one,
                },
                f"{out_dir}/fsdp.pt",
            )
        with open(f"{out_dir}/fsdp_{rank}.json", "w") as f:
            json.dump({"stats": stats, "counts": counts}, f)
    finally:
        dist.destroy_process_group()


# Any two of these exceed micro_batch_tokens=16: of the minibatch of 3, one rank gets one
# sequence and the other two, in two micro-batches, so the first rank must pad.
FSDP_LENGTHS = (9, 10, 11, 12, 13)


def _batch_for(model_path):
    # The behaviour logprobs come from the unsharded model, the same on every rank.
    return _batch(PPOTrainer(_cfg(model_path), device="cpu"), FSDP_LENGTHS)


def test_two_fsdp_ranks_take_the_step_one_process_takes_and_resume_exactly(model_path, tmp_path):
    mp.spawn(
        _fsdp_worker,
        args=(model_path, str(tmp_path / "store"), str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=True,
    )
    got = torch.load(tmp_path / "fsdp.pt")
    ranks = [json.loads((tmp_path / f"fsdp_{r}.json").read_text()) for r in range(WORLD_SIZE)]

    # Every rank ran as many forwards/backwards; one padded its shorter share.
    assert ranks[0]["counts"]["all"] == ranks[1]["counts"]["all"]
    assert sum(r["counts"]["padding"] for r in ranks) > 0, ranks

    single = PPOTrainer(_fsdp_cfg(model_path, 1), device="cpu")
    assert not single.fsdp
    initial = _flat_params(single)
    single_grads = _grads_at_optimizer_steps(single)
    single_stats = single.train_step(_batch(single, FSDP_LENGTHS))
    assert len(got["grads"]) == len(single_grads) == 2
    for step, (g, want) in enumerate(zip(got["grads"], single_grads, strict=True)):
        assert_close(g, want, rtol=1e-3, atol=1e-3 * want.abs().max().item(), msg=f"step {step}")
    for key in ("ppo/loss", "ppo/clip_frac", "ppo/grad_norm"):
        assert ranks[0]["stats"][key] == pytest.approx(single_stats[key], rel=1e-4, abs=1e-6), key

    # Saved weights are the gathered full parameters; the parameters moved.
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "weights").state_dict()
    assert torch.equal(torch.cat([saved[k].reshape(-1) for k in sorted(saved)]), got["after_one"])
    assert not torch.equal(torch.sort(initial).values, torch.sort(got["after_one"]).values)

    # Resuming restores the parameters, the version and the optimizer: the next step repeats.
    assert got["resumed_version"] == 1
    assert torch.equal(got["resumed"], got["after_one"])
    assert not torch.equal(got["after_two"], got["after_one"])
    assert torch.equal(got["again"], got["after_two"])

    # Each rank wrote its part: weight files in turn, its optimizer shards.
    ckpt = tmp_path / "ckpt"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and all((ckpt / f).is_file() for f in files)
    assert sorted(p.name for p in (ckpt / "optimizer").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # One worker resumes the two workers' checkpoint: the same parameters and optimizer state.
    one = PPOTrainer(_fsdp_cfg(model_path, 1), device="cpu")
    one.load_checkpoint(ckpt)
    assert one.version == 1
    assert torch.equal(_sorted_flat(one.model.state_dict()), got["after_one"])
    want_opt = got["optimizer_one"]
    have_opt = optimizer_state_by_name(one.optimizer.state_dict(), one._param_names())
    assert have_opt["state"].keys() == want_opt["state"].keys()
    for name, moments in want_opt["state"].items():
        for key, value in moments.items():
            assert torch.equal(have_opt["state"][name][key], value), (name, key)
    # The streamed export of that checkpoint is the trained model.
    export_checkpoint(ckpt, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert torch.equal(_sorted_flat(exported.state_dict()), got["after_one"])
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, one.model(ids).logits)


# --------------------------------------------------------------------------- FSDP2 + LoRA


def _lora_fsdp_cfg(model_path, train_workers):
    return RunConfig.from_dict(
        {
            **_fsdp_cfg(model_path, train_workers).to_dict(),
            "lora_rank": 8,
            "lora_alpha": 16.0,
            # A KL term: the reference is the sharded model with its adapter off.
            "kl_coef": 0.1,
        }
    )


def _nonzero_adapter(trainer):
    """Random ``lora_B`` (peft starts it at zero, the adapter a no-op), the same on every rank
    and in one process: the policy differs from the KL reference from the first step."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                full = 0.005 * torch.randn(p.shape, generator=gen)
                if isinstance(p, DTensor):
                    full = distribute_tensor(full, p.device_mesh, p.placements)
                p.copy_(full)


def _full_split(trainer):
    """``(adapter, base)`` full tensors by parameter name, on rank 0 (``None`` elsewhere)."""
    from rl_core.distributed import full_model_state

    state = full_model_state(trainer.model)  # a collective: every rank calls it
    if not state:
        return None
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapter = {k: v.clone() for k, v in state.items() if k in trainable}
    base = {k: v.clone() for k, v in state.items() if k not in trainable}
    return adapter, base


def _lora_fsdp_worker(rank, model_path, store, out_dir):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        trainer = PPOTrainer(_lora_fsdp_cfg(model_path, WORLD_SIZE), device="cpu")
        assert trainer.fsdp and trainer.lora and trainer.ref_model is None
        held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        _nonzero_adapter(trainer)
        initial = _full_split(trainer)
        grads = _full_grads_at_optimizer_steps(trainer)
        batch = _batch_for(model_path)
        stats = trainer.train_step(batch)
        trainer.save_weights(f"{out_dir}/weights")
        trainer.save_checkpoint(f"{out_dir}/ckpt")
        after_one = _full_split(trainer)
        trainer.train_step(batch)
        after_two = _full_split(trainer)
        trainer.load_checkpoint(f"{out_dir}/ckpt")
        resumed_version = trainer.version
        resumed = _full_split(trainer)
        trainer.train_step(batch)
        again = _full_split(trainer)
        # Rank 0 alone reads the files; what it finds wrong is raised on every rank (none hangs).
        with pytest.raises(FileNotFoundError, match="holds no LoRA adapter"):
            trainer.load_checkpoint(f"{out_dir}/weights")
        # A one-process checkpoint (the test wrote it before spawning us) resumes here too.
        trainer.load_checkpoint(f"{out_dir}/single_ckpt")
        from_single = _full_split(trainer)
        trainer.train_step(batch)
        from_single_next = _full_split(trainer)
        if rank == 0:
            torch.save(
                {
                    "held": len(held),
                    "trainable": trainable,
                    "grads": grads[:2],
                    "initial": initial,
                    "after_one": after_one,
                    "after_two": after_two,
                    "resumed": resumed,
                    "again": again,
                    "resumed_version": resumed_version,
                    "from_single": from_single,
                    "from_single_next": from_single_next,
                    "stats": stats,
                },
                f"{out_dir}/lora_fsdp.pt",
            )
    finally:
        dist.destroy_process_group()


def test_two_fsdp_lora_ranks_take_the_one_process_step_save_merged_weights_and_resume(
    model_path, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_core import lora

    # One process first: two steps, with a checkpoint after the first for the ranks to resume.
    single = PPOTrainer(_lora_fsdp_cfg(model_path, 1), device="cpu")
    assert not single.fsdp
    _nonzero_adapter(single)
    single_grads = _grads_at_optimizer_steps(single)
    single_stats = single.train_step(_batch_for(model_path))
    single_grads = list(single_grads)
    single.save_checkpoint(tmp_path / "single_ckpt")
    single_one = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    single.train_step(_batch_for(model_path))
    single_two = {n: p.detach().clone() for n, p in single.model.named_parameters()}

    mp.spawn(
        _lora_fsdp_worker,
        args=(model_path, str(tmp_path / "store"), str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=True,
    )
    got = torch.load(tmp_path / "lora_fsdp.pt")

    # The optimizer holds the adapter only; the sharded run trains the names one process does.
    single_names = [n for n, p in single.model.named_parameters() if p.requires_grad]
    assert got["trainable"] == single_names and all(".lora_" in n for n in single_names)
    assert got["held"] == len(single_names)

    # The same step: the adapter's gradients at each optimizer step (KL term included).
    assert len(got["grads"]) == len(single_grads) == 2
    for step, (g, want) in enumerate(zip(got["grads"], single_grads, strict=True)):
        assert_close(g, want, rtol=1e-3, atol=1e-3 * want.abs().max().item(), msg=f"step {step}")
    assert got["stats"]["ppo/kl_ref"] > 1e-3  # the reference (adapter off) is another model
    for key in ("ppo/loss", "ppo/kl_ref", "ppo/grad_norm"):
        assert got["stats"][key] == pytest.approx(single_stats[key], rel=1e-4, abs=1e-6), key

    # The base weights never move: bit-identical before, after training and after resuming.
    (adapter0, base0), (adapter1, base1) = got["initial"], got["after_one"]
    for state in ("after_one", "after_two", "again"):
        assert all(torch.equal(base0[k], got[state][1][k]) for k in base0), state
    assert any(not torch.equal(adapter0[k], adapter1[k]) for k in adapter0)

    # save_weights merges the gathered adapter into the gathered base weights: the same
    # merge of the same tensors as one process's, under the base model's key names.
    for name, p in single.model.named_parameters():
        with torch.no_grad():
            p.copy_(adapter1[name] if p.requires_grad else base1[name])
    want = lora.merged_state_dict(single.model, single.save_dtype)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "weights", dtype=torch.float32)
    saved_state = saved.state_dict()
    assert sorted(saved_state) == sorted(want)
    for k in want:
        assert_close(saved_state[k], want[k], rtol=0, atol=1e-6, msg=k)

    # The checkpoint is the adapter only, in peft's format.
    ckpt = tmp_path / "ckpt"
    assert (ckpt / lora.ADAPTER_WEIGHTS).is_file() and not (ckpt / "model.safetensors").exists()
    base_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    from_peft = PeftModel.from_pretrained(base_model, str(ckpt))
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])
    with torch.no_grad():
        assert_close(
            from_peft(input_ids=ids).logits, saved(input_ids=ids).logits, rtol=0, atol=1e-4
        )

    # Resuming in two ranks restores adapter, version and optimizer: the next step repeats.
    assert got["resumed_version"] == 1
    assert all(torch.equal(got["resumed"][0][k], adapter1[k]) for k in adapter1)
    assert any(not torch.equal(got["after_two"][0][k], adapter1[k]) for k in adapter1)
    assert all(torch.equal(got["again"][0][k], got["after_two"][0][k]) for k in adapter1)

    # One process resumes it too (adapter and the optimizer state keyed by name), and its
    # next step is the two ranks' second step.
    resumed = PPOTrainer(_lora_fsdp_cfg(model_path, 1), device="cpu")
    resumed.load_checkpoint(ckpt)
    assert resumed.version == 1
    state = dict(resumed.model.named_parameters())
    assert all(torch.equal(state[k].detach(), adapter1[k]) for k in adapter1)
    resumed.train_step(_batch_for(model_path))
    for k, v in got["after_two"][0].items():
        # Adam's step from restored moments is smooth in the gradient: float noise stays
        # far below the 1e-4 learning rate.
        assert_close(state[k].detach(), v, rtol=0, atol=1e-6, msg=k)

    # And the other way: the one-process checkpoint resumes in two ranks, whose next step
    # is the one process's second.
    assert all(torch.equal(got["from_single"][0][k], single_one[k]) for k in adapter1)
    for k, v in got["from_single_next"][0].items():
        assert_close(v, single_two[k], rtol=0, atol=1e-6, msg=k)
