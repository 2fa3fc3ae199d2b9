"""A distillation run with the teacher's top-k (``distill_topk``, slow): through the whole loop
with real torch engines (the teacher's answers its top-k; the student's the loop updates), the
forward-KL term trains and ``distill/topk_forward_kl`` is reported every step."""

from __future__ import annotations

import math

import pytest

from rl_core.config import RunConfig
from rl_core.distill import SGLangTeacher, TeacherScorer
from rl_core.loop import ListReporter
from rl_core.rollout import LocalRun
from rl_core.toy import TOY_SETTINGS, toy_rows
from tests.distill_teacher import rl_teacher

pytestmark = pytest.mark.slow

STEPS = 3


async def test_a_run_with_the_teachers_top_k_trains_its_forward_kl_and_reports_it(
    tiny_model_dir, torch_engine_factory, tmp_path_factory, tmp_path
):
    import torch

    from rl_core.trainer import PPOTrainer

    teacher_dir, _ = await rl_teacher(
        tiny_model_dir,
        torch_engine_factory(weight_version=0).url,
        tmp_path_factory.mktemp("topk-teacher") / "model",
        steps=4,  # another model than the student: something to learn
    )
    teacher_engine = torch_engine_factory(teacher_dir, weight_version=0)
    cfg = RunConfig.from_dict(
        {
            "base_model": str(tiny_model_dir),
            **TOY_SETTINGS,
            "teacher_url": teacher_engine.url,
            "reward_weight": 0.0,
            "distill_topk": 4,
            "max_steps": STEPS,
        }
    )
    trainer = PPOTrainer(cfg, model_path=tiny_model_dir, device="cpu")
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    reporter = ListReporter()
    scorer = TeacherScorer(SGLangTeacher(teacher_engine.url), topk=cfg.distill_topk)
    try:
        await LocalRun(
            cfg,
            trainer=trainer,
            urls=[torch_engine_factory(weight_version=0).url],
            rows=toy_rows(64, seed=0),
            weights_dir=tmp_path / "weights",
            reporter=reporter,
            teacher=scorer,
        ).run()
    finally:
        await scorer.aclose()
    kl = reporter.series("distill/topk_forward_kl")
    mass = reporter.series("distill/topk_teacher_mass")
    assert len(kl) == len(mass) == STEPS
    assert all(math.isfinite(v) for v in kl) and kl[0] > 0.1, kl
    assert all(0.0 < m <= 1.0 + 1e-6 for m in mass), mass
    assert kl[-1] < kl[0], kl  # the student moved towards the teacher's top-k
    assert reporter.series("distill/teacher_calls") == [float(cfg.batch_size)] * STEPS
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "parameters must change"
