import math

import pytest
import torch
from torch.testing import assert_close

from rl_core.config import RunConfig
from rl_core.loop import ListReporter, QueueSource, TrainingLoop
from rl_core.metrics import StatsAccumulator, logprob_gap
from rl_core.packing import pack, packed_logprobs
from rl_core.trainer import PPOTrainer, lr_factor
from rl_core.types import Trajectory


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return str(tiny_model_dir)


def _cfg(model_path, **overrides):
    settings = {
        "base_model": model_path,
        "reward": {"type": "exact_match"},
        "batch_size": 4,
        "group_size": 2,
        "learning_rate": 1e-2,
        "max_steps": 10,
        **overrides,
    }
    return RunConfig.from_dict(settings)


def _on_policy(trainer, ids, n_prompt, reward, group_id="g", version=None):
    """A trajectory whose behaviour logprobs are the trainer's current ones (as fresh inference would report)."""
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    v = trainer.version if version is None else version
    probe = Trajectory(
        ids, mask, [0.0] * len(ids), [v if m else -1 for m in mask], [reward], group_id
    )
    with torch.no_grad():
        logprobs, _ = packed_logprobs(trainer.model, pack([probe]))
    probe.logprobs = [lp * m for lp, m in zip(logprobs.tolist(), mask, strict=True)]
    return probe


def _batch(trainer, seed=0, version=None):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(4):
        ids = torch.randint(0, 256, (6 + 3 * i,), generator=g).tolist()
        trajs.append(
            _on_policy(trainer, ids, 3, reward=float(i % 2), group_id=str(i // 2), version=version)
        )
    return trajs


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


async def _loop_once(trainer, batch):
    """``batch`` through one step of the training loop, which drops stale trajectories
    before the trainer sees them; the source then runs dry. Returns the source and reporter."""
    source, reporter = QueueSource(), ListReporter()
    for i, traj in enumerate(batch):
        await source.put(str(i), traj)
    source.close()
    await TrainingLoop(trainer.cfg, trainer, source, None, reporter).run(max_steps=1)
    return source, reporter


def _grads_at_optimizer_step(trainer):
    """The (accumulated, clipped) gradients each optimizer step starts from, in order."""
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.append([p.grad.detach().clone() for p in trainer.params])
    )
    return seen


def _sequence_logprob(trainer, traj):
    with torch.no_grad():
        logprobs, _ = packed_logprobs(trainer.model, pack([traj]))
    return (logprobs * torch.tensor(traj.loss_mask)).sum().item()


def test_train_step_changes_the_parameters_and_bumps_the_version(model_path):
    trainer = PPOTrainer(_cfg(model_path))
    before = _params(trainer)
    stats = trainer.train_step(_batch(trainer))
    after = _params(trainer)
    assert trainer.version == 1 and stats["version"] == 1.0
    assert all(not torch.equal(before[k], after[k]) for k in before), "every weight gets a gradient"
    for key in (
        "rollout/reward",
        "ppo/loss",
        "ppo/clip_frac",
        "ppo/approx_kl",
        "ppo/behav_imp_weight",
        "staleness/max",
        "staleness/mean",
        "perf/tokens_per_s",
        "ppo/grad_norm",
        "ppo/lr",
        "ppo/entropy",
        "timing/proximal_logprobs",
        "timing/forward_backward",
    ):
        assert math.isfinite(stats[key]), key
    assert stats["rollout/reward"] == 0.5
    assert stats["ppo/lr"] == 1e-2
    # On-policy first minibatch: proximal == behaviour == current.
    assert stats["ppo/behav_imp_weight"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ppo/approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_positive_advantage_tokens_get_more_likely(model_path):
    trainer = PPOTrainer(_cfg(model_path, learning_rate=1e-3))
    prompt = [10, 20, 30]
    good = _on_policy(trainer, prompt + [40, 41, 42, 43], 3, reward=1.0)
    bad = _on_policy(trainer, prompt + [50, 51, 52, 53], 3, reward=0.0)
    before = (_sequence_logprob(trainer, good), _sequence_logprob(trainer, bad))
    trainer.train_step([good, bad])
    after = (_sequence_logprob(trainer, good), _sequence_logprob(trainer, bad))
    assert after[0] > before[0]
    assert after[1] < before[1]


async def test_stale_trajectories_are_dropped_and_counted(model_path):
    trainer = PPOTrainer(_cfg(model_path, max_staleness=1))
    trainer.version = 3
    batch = _batch(trainer, version=3)
    batch[0].versions = [1 if m else -1 for m in batch[0].loss_mask]  # 2 behind
    batch[1].versions = [2 if m else -1 for m in batch[1].loss_mask]  # 1 behind
    _, reporter = await _loop_once(trainer, batch)
    ((_, _, stats),) = reporter.metrics_log
    assert stats["staleness/dropped"] == 1.0
    assert stats["staleness/max"] == 1.0
    assert stats["staleness/mean"] == pytest.approx(1 / 3)
    assert stats["rollout/num_trajectories"] == 3.0


async def test_a_batch_with_nothing_fresh_enough_trains_nothing(model_path):
    trainer = PPOTrainer(_cfg(model_path, max_staleness=0))
    batch = _batch(trainer)
    trainer.version = 1
    before = _params(trainer)
    source, reporter = await _loop_once(trainer, batch)
    assert source.dropped == 4 and source.trained == 0 and reporter.metrics_log == []
    assert trainer.version == 1
    assert all(torch.equal(before[k], v) for k, v in _params(trainer).items())


def test_gradient_accumulation_over_micro_batches_takes_the_same_step(model_path):
    # Compare the gradients the optimizer gets, not the parameters after its step: AdamW's
    # first step is about lr * sign(grad), so float-summation-order noise in a near-zero
    # gradient flips whole learning-rate-sized updates. No clipping: it would rescale a
    # wrongly normalised gradient back to the same norm.
    whole = PPOTrainer(_cfg(model_path, micro_batch_tokens=8192, max_grad_norm=0.0))
    micro = PPOTrainer(_cfg(model_path, micro_batch_tokens=16, max_grad_norm=0.0))  # 1 per micro
    g_whole, g_micro = _grads_at_optimizer_step(whole), _grads_at_optimizer_step(micro)
    batch = _batch(whole)
    s_whole, s_micro = whole.train_step(batch), micro.train_step(batch)
    assert s_whole["ppo/loss"] == pytest.approx(s_micro["ppo/loss"], abs=1e-6)
    assert len(g_whole) == len(g_micro) == 1
    names = [name for name, p in whole.model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, g_whole[0], g_micro[0], strict=True):
        # Packing one trajectory per micro-batch changes the matmul shapes, so float32 sums
        # run in another order: measured within 1e-5 of each tensor's largest gradient. A
        # missing (or doubled) 1/N normalisation is off by 25% or more.
        assert_close(b, a, rtol=1e-3, atol=1e-3 * a.abs().max().item(), msg=name)


def test_minibatches_take_several_optimizer_steps_with_kl_and_entropy(model_path):
    trainer = PPOTrainer(_cfg(model_path, ppo_minibatches=2, kl_coef=0.1, entropy_coef=0.01))
    stats = trainer.train_step(_batch(trainer))
    assert trainer.optimizer.state_dict()["state"][0]["step"] == 2
    # The first minibatch starts at the reference weights; the second has moved away from them.
    assert stats["ppo/kl_ref"] > 0
    assert trainer.version == 1


def test_checkpoint_round_trip_resumes_identically(model_path, tmp_path):
    cfg = _cfg(model_path, lr_schedule="cosine", lr_warmup_steps=1, weight_decay=0.1)
    first = PPOTrainer(cfg)
    first.train_step(_batch(first, seed=1))
    first.save_checkpoint(tmp_path / "ckpt")
    next_batch = _batch(first, seed=2)
    expected = first.train_step(next_batch)

    resumed = PPOTrainer(cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.version == 1
    got = resumed.train_step(next_batch)
    assert got["ppo/loss"] == expected["ppo/loss"]
    assert got["ppo/lr"] == expected["ppo/lr"]
    for (k, a), b in zip(_params(first).items(), _params(resumed).values(), strict=True):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_checkpoint_snapshot_written_after_more_steps_holds_the_step_it_was_taken_at(
    model_path, tmp_path, lora
):
    # An asynchronous checkpoint: copied between two steps, written while the next step
    # trains. What lands on disk is the state of the step it was taken at, so resuming from it
    # equals resuming from a checkpoint written right then.
    cfg = _cfg(model_path, **({"lora_rank": 4, "lora_alpha": 8.0} if lora else {}))
    first = PPOTrainer(cfg)
    first.train_step(_batch(first, seed=1))
    write = first.checkpoint_snapshot()
    assert write is not None
    first.save_checkpoint(tmp_path / "in_step")
    next_batch = _batch(first, seed=2)
    expected = first.train_step(next_batch)  # updates the model and optimizer in place
    write(str(tmp_path / "snapshot"))

    for name in ("in_step", "snapshot"):
        resumed = PPOTrainer(cfg)
        resumed.load_checkpoint(tmp_path / name)
        assert resumed.version == 1, name
        got = resumed.train_step(next_batch)
        assert got["ppo/loss"] == expected["ppo/loss"], name
        for (k, a), b in zip(_params(first).items(), _params(resumed).values(), strict=True):
            assert torch.equal(a, b), (name, k)


def test_a_new_run_starts_from_another_runs_checkpoint_with_fresh_optimizer_state(
    model_path, tmp_path
):
    first = PPOTrainer(_cfg(model_path))
    first.train_step(_batch(first, seed=1))
    first.save_checkpoint(tmp_path / "ckpt")  # float32, with optimizer state and version 1

    clone = PPOTrainer(_cfg(model_path, init_checkpoint=str(tmp_path / "ckpt")))
    assert clone.version == 0  # a new run: its own versions and steps
    assert not clone.optimizer.state
    for (k, a), b in zip(_params(first).items(), _params(clone).values(), strict=True):
        assert torch.equal(a, b), k
    assert clone.save_dtype == PPOTrainer(_cfg(model_path)).save_dtype  # the base model's
    clone.train_step(_batch(clone, seed=2))
    assert any(
        not torch.equal(a, b)
        for a, b in zip(_params(first).values(), _params(clone).values(), strict=True)
    )


def test_saved_weights_load_with_from_pretrained(model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = PPOTrainer(_cfg(model_path))
    trainer.train_step(_batch(trainer))
    out = trainer.save_weights(tmp_path / "weights")
    assert (tmp_path / "weights" / "model.safetensors").exists()
    assert not (tmp_path / "weights.tmp").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (k, a), b in zip(
        trainer.model.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    trainer.save_weights(tmp_path / "weights")  # overwriting an existing directory works


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [
        ("constant", 0, 0.5),  # warm-up: (0 + 1) / 2
        ("constant", 1, 1.0),
        ("constant", 9, 1.0),
        ("linear", 2, 1.0),  # decay starts after 2 warm-up steps, over 8 steps
        ("linear", 6, 0.5),
        ("cosine", 6, 0.5),  # halfway: 0.5 * (1 + cos(pi/2))
        ("cosine", 4, 0.5 * (1 + math.cos(math.pi / 4))),
    ],
)
def test_lr_schedule_warms_up_then_decays(schedule, step, expected):
    assert lr_factor(step, schedule, warmup_steps=2, total_steps=10) == pytest.approx(expected)


async def test_trainer_agrees_with_the_inference_servers_logprobs_before_and_after_a_weight_update(
    torch_engine_factory, model_path, tmp_path
):
    from rl_core.inference.client import InferenceClient

    server = torch_engine_factory(weight_version=0)  # our own: we change its weights
    trainer = PPOTrainer(_cfg(model_path))
    prompt = [72, 101, 108, 108, 111]
    params = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True}

    def trajectory(result, reward):
        n = len(result.output_ids)
        return Trajectory(
            input_ids=prompt + result.output_ids,
            loss_mask=[0] * len(prompt) + [1] * n,
            logprobs=[0.0] * len(prompt) + result.output_logprobs,
            versions=[-1] * len(prompt) + result.versions,
            rewards=[reward],
            group_id="g",
            temperatures=[1.0] * len(prompt) + [0.8] * n,  # the turn's, as recorded
        )

    async with InferenceClient(server.url) as client:
        results = [await client.generate(prompt, {**params, "sampling_seed": s}) for s in range(4)]
        stats = trainer.train_step([trajectory(r, float(i % 2)) for i, r in enumerate(results)])
        # Sampled at temperature 0.8 with top-p, yet behaviour == proximal: one definition of logprob.
        assert stats["ppo/behav_imp_weight_max"] == pytest.approx(1.0, abs=1e-3)
        assert stats["ppo/behav_imp_weight"] == pytest.approx(1.0, abs=1e-4)
        # The same in absolute logprob: the engine's and the trainer's numerics agree.
        assert stats["rollout/logprob_gap"] < 1e-4 and stats["rollout/logprob_gap_max"] < 1e-3

        path = trainer.save_weights(tmp_path / "v1")
        await client.update_weights_from_disk(path, weight_version=trainer.version)
        fresh = trajectory(await client.generate(prompt, {**params, "sampling_seed": 9}), 0.0)
    assert fresh.oldest_version == 1
    with torch.no_grad():
        recomputed, _ = packed_logprobs(trainer.model, pack([fresh]))
    assert_close(
        recomputed[len(prompt) :], torch.tensor(fresh.logprobs[len(prompt) :]), atol=1e-4, rtol=1e-4
    )


def test_stats_accumulator_weights_means_and_keeps_maxima():
    acc = StatsAccumulator()
    acc.add({"ppo/clip_frac": 1.0, "ppo/w_max": 2.0}, weight=1.0)
    acc.add({"ppo/clip_frac": 4.0, "ppo/w_max": 1.0}, weight=3.0)
    assert acc.result() == {"ppo/clip_frac": 13 / 4, "ppo/w_max": 2.0}


def test_the_logprob_gap_counts_only_trained_tokens_of_the_trainers_own_version():
    recomputed = torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0])
    behaviour = torch.tensor([0.0, -1.5, -2.0, -3.0, -2.0])
    mask = torch.tensor([0, 1, 1, 1, 0])  # the last token is not trained
    versions = torch.tensor([-1, 3, 3, 2, 3])  # token 3 came from an older version
    stats, count = logprob_gap(recomputed, behaviour, mask, versions, 3)
    assert count == 2
    assert stats == {"rollout/logprob_gap": 0.25, "rollout/logprob_gap_max": 0.5}
    assert logprob_gap(recomputed, behaviour, mask, versions, 4) == ({}, 0)


def test_a_train_step_reports_how_far_behaviour_logprobs_are_from_its_own(model_path):
    trainer = PPOTrainer(_cfg(model_path))
    batch = _batch(trainer)
    for traj in batch:  # an engine 0.25 nats off on every generated token
        traj.logprobs = [lp - 0.25 * m for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True)]
    stats = trainer.train_step(batch)
    assert stats["rollout/logprob_gap"] == pytest.approx(0.25, abs=1e-5)
    stale = trainer.train_step(_batch(trainer, version=trainer.version - 1))
    assert "rollout/logprob_gap" not in stale  # no token of the trainer's weights: no gap
