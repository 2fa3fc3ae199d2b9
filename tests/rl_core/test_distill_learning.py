"""On-policy distillation learns (issue 38, slow): a student distilled from a teacher good at the
toy task (the tiny model after RL on it), on the teacher's per-token signal alone (reward_weight
0), through the whole loop with real torch engines (the student's, which the loop updates, and
the teacher's)."""

from __future__ import annotations

import pytest

from rl_core.config import RunConfig
from rl_core.distill import SGLangTeacher, TeacherScorer
from rl_core.loop import ListReporter
from rl_core.rollout import LocalRun
from rl_core.toy import TOY_SETTINGS, toy_rows
from tests.distill_teacher import rl_teacher

pytestmark = pytest.mark.slow


async def test_a_student_distilled_from_a_teacher_learns_and_its_reverse_kl_falls(
    tiny_model_dir, torch_engine_factory, tmp_path_factory, tmp_path
):
    import torch

    from rl_core.trainer import PPOTrainer

    teacher_dir, teacher_rewards = await rl_teacher(
        tiny_model_dir,
        torch_engine_factory(weight_version=0).url,
        tmp_path_factory.mktemp("teacher") / "model",
    )
    assert sum(teacher_rewards[-3:]) / 3 > 0.6, teacher_rewards  # a teacher good at the task
    teacher_engine = torch_engine_factory(teacher_dir, weight_version=0)
    student_engine = torch_engine_factory(weight_version=0)
    cfg = RunConfig.from_dict(
        {
            "base_model": str(tiny_model_dir),
            **TOY_SETTINGS,
            "teacher_url": teacher_engine.url,
            "reward_weight": 0.0,  # the teacher's signal alone
            "max_steps": 8,
        }
    )
    trainer = PPOTrainer(cfg, model_path=tiny_model_dir, device="cpu")
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    reporter = ListReporter()
    scorer = TeacherScorer(SGLangTeacher(teacher_engine.url))
    try:
        await LocalRun(
            cfg,
            trainer=trainer,
            urls=[student_engine.url],
            rows=toy_rows(64, seed=0),
            weights_dir=tmp_path / "weights",
            reporter=reporter,
            teacher=scorer,
        ).run()
    finally:
        await scorer.aclose()
    kl = reporter.series("distill/reverse_kl")
    rewards = reporter.series("rollout/reward")
    assert len(kl) == len(rewards) == 8
    # Every served token was scored: a call per trajectory, its every token.
    assert reporter.series("distill/teacher_calls") == [float(cfg.batch_size)] * 8
    assert min(reporter.series("distill/teacher_tokens")) > cfg.batch_size * 8
    assert sum(kl[-3:]) / 3 < kl[0] / 4, kl  # the student moved towards the teacher
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.4, rewards  # and so towards the task
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "parameters must change"
