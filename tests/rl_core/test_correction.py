"""Rollout correction (rl_core.correction): each correction's loss and masks on a batch computed
by hand, the mismatch metrics, and the trainer's denominator recount."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.config import ConfigError, RunConfig
from rl_core.correction import MismatchMeter
from rl_core.loss import LossConfig, ppo_loss

# Three sequences, packed. Behaviour weights w = exp(p - b) per token:
#   A: 100 (not trained), 1, 3, 0.25   advantage +1
#   B: 1.5, 1.2                        advantage -1
#   C: 4, 2                            advantage +2
W = [100.0, 1.0, 3.0, 0.25, 1.5, 1.2, 4.0, 2.0]
MASK = [0, 1, 1, 1, 1, 1, 1, 1]
SEQ = [0, 0, 0, 0, 1, 1, 2, 2]
ADV = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 2.0, 2.0]
CAP, LOW, HIGH = 2.0, 0.5, 2.0


def _loss(mode, loss_agg="token_mean"):
    behaviour = torch.full((len(W),), -2.0)
    proximal = behaviour + torch.log(torch.tensor(W))
    cfg = LossConfig(
        behav_imp_weight_cap=CAP,
        rollout_correction=mode,
        correction_ratio_low=LOW,
        correction_ratio_high=HIGH,
        loss_agg=loss_agg,
    )
    # θ = p: every ratio is 1 (no clipping), so each kept token's loss is -A · weight.
    loss, stats = ppo_loss(
        proximal.clone().requires_grad_(),
        proximal,
        behaviour,
        torch.tensor(ADV),
        torch.tensor(MASK),
        cfg,
        seq_ids=torch.tensor(SEQ),
    )
    return loss.item(), stats


def test_each_correction_weights_and_masks_as_computed_by_hand():
    # cap_mask (the default): w > 2 masked (A's 3, C's 4), all 7 trained tokens in the
    # denominator: -(1 + 0.25) + (1.5 + 1.2) - 2·2.
    assert _loss("cap_mask")[0] == pytest.approx((-1.25 + 2.7 - 4.0) / 7)
    # truncate: min(w, 2), nothing masked: -(1 + 2 + 0.25) + 2.7 - 2·(2 + 2).
    assert _loss("truncate")[0] == pytest.approx((-3.25 + 2.7 - 8.0) / 7)
    # token_band [0.5, 2]: A keeps only its 1, C only its 2; 4 tokens left in the denominator.
    loss, stats = _loss("token_band")
    assert loss == pytest.approx((-1.0 + 2.7 - 4.0) / 4)
    assert stats["ppo/behav_masked_frac"] == pytest.approx(3 / 7)
    # sequence_reject: geometric means A 0.75^(1/3) = 0.91, B 1.8^(1/2) = 1.34 kept, C 8^(1/2)
    # = 2.83 rejected whole; A and B keep their own token weights; 5 tokens left.
    assert _loss("sequence_reject")[0] == pytest.approx((-(1 + 3 + 0.25) + 2.7) / 5)
    # seq_mean: the mean over each kept sequence's kept tokens, over the 2 kept sequences.
    seq_mean = _loss("sequence_reject", "seq_mean")[0]
    assert seq_mean == pytest.approx((-(1 + 3 + 0.25) / 3 + 2.7 / 2) / 2)


def test_the_default_correction_is_the_loss_before_the_setting():
    # The loss before rollout_correction existed, written out: tokens with w above the cap
    # get no policy loss and stay in the denominator.
    w = torch.tensor(W)
    mask = torch.tensor(MASK).bool()
    valid = mask & (w <= CAP)
    before = (-torch.tensor(ADV) * torch.where(valid, w, 0.0)).sum() / mask.sum()
    assert _loss("cap_mask")[0] == pytest.approx(before.item(), rel=1e-7)
    assert LossConfig().rollout_correction == "cap_mask"
    assert RunConfig.from_dict({"base_model": "m", "mode": "online"}).rollout_correction == (
        "cap_mask"
    )


def test_the_mismatch_meter_reports_the_gap_and_what_each_correction_masks():
    behaviour = torch.full((len(W),), -2.0)
    proximal = behaviour + torch.log(torch.tensor(W))
    meter = MismatchMeter(CAP, LOW, HIGH)
    # Two micro-batches: A + B, then C (its own sequence ids), as the trainer adds them.
    meter.add(proximal[:6], behaviour[:6], torch.tensor(MASK[:6]), torch.tensor(SEQ[:6]))
    meter.add(proximal[6:], behaviour[6:], torch.tensor(MASK[6:]), torch.tensor([0, 0]))
    stats = meter.result()
    trained = [w for w, m in zip(W, MASK, strict=True) if m]
    logs = [math.log(w) for w in trained]
    assert stats["correction/log_ratio_mean"] == pytest.approx(sum(logs) / 7)
    assert stats["correction/log_ratio_p50"] == pytest.approx(math.log(1.5))
    assert stats["correction/kl_k3"] == pytest.approx(
        sum((w - 1) - math.log(w) for w in trained) / 7
    )
    assert stats["correction/masked_tokens/cap_mask"] == pytest.approx(2 / 7)
    assert stats["correction/masked_seqs/cap_mask"] == pytest.approx(2 / 3)
    assert stats["correction/capped_tokens/truncate"] == pytest.approx(2 / 7)
    assert stats["correction/masked_tokens/token_band"] == pytest.approx(3 / 7)
    assert stats["correction/masked_seqs/token_band"] == pytest.approx(2 / 3)
    assert stats["correction/masked_tokens/sequence_reject"] == pytest.approx(2 / 7)
    assert stats["correction/masked_seqs/sequence_reject"] == pytest.approx(1 / 3)
    assert MismatchMeter(CAP, LOW, HIGH).result() == {}  # nothing trained: no metrics


def test_a_band_must_hold_one():
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_dict({"base_model": "m", "mode": "online", "correction_ratio_low": 1.2})
    assert "correction_ratio_low" in caught.value.errors


def test_the_trainer_recounts_the_denominator_and_reports_the_gap(tiny_model_dir):
    from rl_core.packing import pack, packed_logprobs
    from rl_core.trainer import PPOTrainer
    from rl_core.types import Trajectory

    def trainer(**settings):
        cfg = {"base_model": str(tiny_model_dir), "mode": "online", "batch_size": 4,
               "ppo_minibatches": 2, "learning_rate": 1e-4, **settings}  # fmt: skip
        return PPOTrainer(RunConfig.from_dict(cfg), device="cpu")

    reference = trainer()
    g = torch.Generator().manual_seed(0)
    batch = []
    for i, length in enumerate((9, 12, 14, 17)):
        ids = torch.randint(0, 256, (length,), generator=g).tolist()
        mask = [0, 0] + [1] * (length - 2)
        traj = Trajectory(ids, mask, [0.0] * length, [0 if m else -1 for m in mask], [float(i)])
        with torch.no_grad():
            logprobs = packed_logprobs(reference.model, pack([traj]))[0].tolist()
        # Behaviour logprobs off by up to ±1 nat: some tokens fall outside a [0.5, 2] band.
        noise = torch.rand(length, generator=g) * 2 - 1
        traj.logprobs = [
            (lp + n) * m for lp, n, m in zip(logprobs, noise.tolist(), mask, strict=True)
        ]
        batch.append(traj)

    def grads(**settings):
        t = trainer(**settings)
        seen = []
        t.optimizer.register_step_pre_hook(
            lambda *_: seen.append(torch.cat([p.grad.reshape(-1) for p in t.params]))
        )
        return seen, t.train_step(batch)

    # A band wide enough to keep every token: the recount gives the count the plan had.
    wide, _ = grads(rollout_correction="token_band", correction_ratio_low=1e-6,
                    correction_ratio_high=1e6)  # fmt: skip
    uncapped, stats = grads(behav_imp_weight_cap=None)
    assert all(torch.equal(a, b) for a, b in zip(wide, uncapped, strict=True))
    # A band that masks: fewer tokens, a smaller denominator, other gradients.
    banded, banded_stats = grads(rollout_correction="token_band")
    assert not torch.equal(banded[0], uncapped[0])
    assert 0 < banded_stats["correction/masked_tokens/token_band"] < 1
    assert banded_stats["ppo/behav_masked_frac"] > 0
    for key in ("log_ratio_mean", "log_ratio_p01", "log_ratio_p99", "kl_k3"):
        assert f"correction/{key}" in stats
    assert stats["correction/kl_k3"] > 0


def _banded_batch(model_path):
    from rl_core.packing import pack, packed_logprobs
    from rl_core.trainer import PPOTrainer
    from rl_core.types import Trajectory

    cfg = {"base_model": str(model_path), "mode": "online"}
    reference = PPOTrainer(RunConfig.from_dict(cfg), device="cpu")
    g = torch.Generator().manual_seed(0)
    batch = []
    for i, length in enumerate((9, 12, 14, 17, 11)):
        ids = torch.randint(0, 256, (length,), generator=g).tolist()
        mask = [0, 0] + [1] * (length - 2)
        traj = Trajectory(ids, mask, [0.0] * length, [0 if m else -1 for m in mask], [float(i)])
        with torch.no_grad():
            logprobs = packed_logprobs(reference.model, pack([traj]))[0].tolist()
        # Behaviour logprobs off by ±0.3 nat around an offset of the sequence's own: the 2nd and
        # 3rd sequences' geometric-mean ratios fall outside [0.8, 1.25].
        offset = (0.0, 0.6, -0.6, 0.1, 0.0)[i]
        noise = (offset + torch.rand(length, generator=g) * 0.6 - 0.3).tolist()
        traj.logprobs = [(lp + n) * m for lp, n, m in zip(logprobs, noise, mask, strict=True)]
        batch.append(traj)
    return batch


def _banded_cfg(model_path, workers, loss_agg):
    return RunConfig.from_dict(
        {"base_model": str(model_path), "mode": "online", "batch_size": 5, "ppo_minibatches": 2,
         "micro_batch_tokens": 16, "train_workers": workers, "loss_agg": loss_agg,
         "rollout_correction": "sequence_reject", "correction_ratio_low": 0.8,
         "correction_ratio_high": 1.25}
    )  # fmt: skip


def _banded_worker(rank, store, out, model_path, batch, loss_agg):
    import datetime

    import torch.distributed as dist

    from rl_core.trainer import PPOTrainer

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        torch.set_num_threads(1)
        trainer = PPOTrainer(_banded_cfg(model_path, 2, loss_agg), device="cpu")
        seen = []
        trainer.optimizer.register_step_pre_hook(
            lambda *_: seen.append(
                torch.cat([p.grad.full_tensor().reshape(-1) for p in trainer.params])
            )
        )
        stats = trainer.train_step(batch)
        if rank == 0:
            torch.save({"grads": seen, "stats": stats}, f"{out}/banded.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
def test_two_workers_recount_what_a_sequence_rejection_masks_as_one_process_does(
    tiny_model_dir, tmp_path, loss_agg
):
    import torch.multiprocessing as mp
    from torch.testing import assert_close

    from rl_core.trainer import PPOTrainer

    batch = _banded_batch(tiny_model_dir)
    mp.spawn(
        _banded_worker,
        args=(str(tmp_path / "store"), str(tmp_path), str(tiny_model_dir), batch, loss_agg),
        nprocs=2,
    )
    got = torch.load(tmp_path / "banded.pt")
    single = PPOTrainer(_banded_cfg(tiny_model_dir, 1, loss_agg), device="cpu")
    seen = []
    single.optimizer.register_step_pre_hook(
        lambda *_: seen.append(torch.cat([p.grad.reshape(-1) for p in single.params]))
    )
    stats = single.train_step(batch)
    rejected = stats["correction/masked_seqs/sequence_reject"]
    assert rejected == pytest.approx(2 / 5), stats
    assert got["stats"]["correction/masked_seqs/sequence_reject"] == pytest.approx(rejected)
    assert got["stats"]["correction/log_ratio_p50"] == pytest.approx(
        stats["correction/log_ratio_p50"]
    )
    # The same gradients at both optimizer steps (float32 noise of the ranks' summation order).
    assert len(got["grads"]) == len(seen) == 2
    for g, want in zip(got["grads"], seen, strict=True):
        assert_close(g, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
