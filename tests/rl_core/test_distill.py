"""On-policy distillation (issue 38): the teacher's per-token signal, its scoring, its refusals."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.testing import assert_close

from rl_core.config import ConfigError, RunConfig
from rl_core.distill import (
    SGLangTeacher,
    TeacherError,
    TeacherScorer,
    check_tokenizer,
    distill_advantages,
    verify_teacher,
)
from rl_core.types import Trajectory


def _traj(ids, mask, behaviour, teacher=None, reward=1.0):
    return Trajectory(
        ids, mask, behaviour, [0 if m else -1 for m in mask], [reward], teacher_logprobs=teacher
    )


def test_the_signal_is_teacher_minus_student_logprob_on_trained_tokens():
    """By hand: tokens 2-3 are trained; d = teacher - behaviour there, 0 on the prompt."""
    traj = _traj(
        [1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -2.0], teacher=[0.0, -0.1, -0.25, -3.0]
    )
    reward_adv = [torch.tensor([0.0, 0.0, 0.8, 0.8])]
    alone = distill_advantages([traj], reward_adv, reward_weight=0.0, distill_weight=1.0)
    assert_close(alone[0], torch.tensor([0.0, 0.0, 0.25, -1.0]))
    # Mixed: 0.5 x the reward's advantage + 2 x the signal.
    mixed = distill_advantages([traj], reward_adv, reward_weight=0.5, distill_weight=2.0)
    assert_close(mixed[0], torch.tensor([0.0, 0.0, 0.4 + 0.5, 0.4 - 2.0]))
    # A trajectory the teacher did not score keeps its (weighted) reward advantage.
    unscored = _traj([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0])
    out = distill_advantages([unscored], [torch.tensor([0.0, 1.0, 1.0])], 0.5, 2.0)
    assert_close(out[0], torch.tensor([0.0, 0.5, 0.5]))


def test_a_trajectory_checks_its_teacher_logprobs_length():
    with pytest.raises(ValueError, match="teacher_logprobs has 2 entries"):
        _traj([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], teacher=[0.0, -1.0])


def test_the_settings_need_an_http_teacher_and_something_to_train():
    base = {"base_model": "m", "mode": "online", "teacher_url": "http://127.0.0.1:1"}
    assert RunConfig.from_dict(base).distill_weight == 1.0
    with pytest.raises(ConfigError) as bad:
        RunConfig.from_dict({**base, "teacher_url": "127.0.0.1:1"})
    assert "teacher_url" in bad.value.errors
    with pytest.raises(ConfigError) as bad:
        RunConfig.from_dict({**base, "distill_weight": 0.0, "reward_weight": 0.0})
    assert "distill_weight" in bad.value.errors
    with pytest.raises(ConfigError) as bad:
        RunConfig.from_dict({**base, "teacher_api": "openai"})
    assert "teacher_model" in bad.value.errors


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    check_tokenizer(str(tiny_model_dir), str(tiny_model_dir))  # the same: accepted
    other = tmp_path / "other-tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(TeacherError) as refused:
        check_tokenizer(str(tiny_model_dir), str(other))
    message = str(refused.value)
    assert str(other) in message and str(tiny_model_dir) in message
    assert "must share one tokenizer" in message


async def test_a_torch_engine_teacher_scores_every_token_as_a_full_forward_does(
    torch_engine, tiny_model_dir, reference
):
    teacher = SGLangTeacher(torch_engine.url)
    try:
        ids = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]
        got = await teacher.logprobs(ids)
        assert len(got) == len(ids) and got[0] == 0.0
        want = reference.logprobs(tiny_model_dir, ids[:1], ids[1:])
        assert_close(torch.tensor(got[1:]), want, atol=1e-4, rtol=0)
        # The served model's own tokenizer: the student's, so it is accepted.
        assert await verify_teacher(teacher, str(tiny_model_dir)) == str(tiny_model_dir)
    finally:
        await teacher.aclose()


async def test_the_engine_reports_a_teacher_whose_tokenizer_differs(
    torch_engine, tiny_model_dir, tmp_path
):
    """The student here has another tokenizer than the model the engine serves."""
    from transformers import AutoTokenizer

    student = tmp_path / "student"
    shutil.copytree(tiny_model_dir, student)
    tokenizer = AutoTokenizer.from_pretrained(student)
    tokenizer.add_tokens(["<student-only>"])
    tokenizer.save_pretrained(student)
    teacher = SGLangTeacher(torch_engine.url)
    try:
        with pytest.raises(TeacherError, match="must share one tokenizer"):
            await verify_teacher(teacher, str(student))
    finally:
        await teacher.aclose()


class _FlakyTeacher:
    """Fails its first ``failures`` calls, then scores every token -1."""

    name = "flaky"

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    async def logprobs(self, input_ids):
        self.calls += 1
        if self.calls <= self.failures:
            raise TeacherError("busy")
        return [0.0] + [-1.0] * (len(input_ids) - 1)

    async def tokenizer_path(self):
        return None

    async def aclose(self):
        pass


async def test_the_scorer_retries_counts_and_reports_the_reverse_kl():
    trajs = [_traj([1, 2, 3], [0, 1, 1], [0.0, -0.5, -1.5]), _traj([4, 5], [0, 1], [0.0, -3.0])]
    scorer = TeacherScorer(_FlakyTeacher(failures=1), concurrency=1, backoff_s=0.0)
    stats = await scorer.score(trajs)
    assert trajs[0].teacher_logprobs == [0.0, -1.0, -1.0]
    assert stats["distill/teacher_calls"] == 3 and stats["distill/teacher_retries"] == 1
    assert stats["distill/teacher_tokens"] == 5
    # reverse KL = mean(student - teacher) over the trained tokens: (0.5 - 0.5 - 2.0) / 3
    assert stats["distill/reverse_kl"] == pytest.approx((0.5 - 0.5 - 2.0) / 3)
    with pytest.raises(TeacherError, match="after 2 tries"):
        await TeacherScorer(_FlakyTeacher(failures=5), retries=1, backoff_s=0.0).score(trajs)


def test_a_teacher_url_and_tokenizer_obey_the_instances_rules(tiny_model_dir, tmp_path):
    """The teacher is an outbound URL as a judge's is (a loopback one is refused unless the
    operator allowed it), and its tokenizer a directory the job reads, as a model is."""
    from rl_core.sources import SourceRules, config_source_errors

    cfg = RunConfig.from_dict(
        {
            "base_model": str(tiny_model_dir),
            "mode": "online",
            "teacher_url": "http://127.0.0.1:30000",
            "teacher_tokenizer": "/etc",
        }
    )
    errors = config_source_errors(cfg, SourceRules(model_roots=(str(tiny_model_dir.parent),)))
    assert "loopback" in " ".join(errors["teacher_url"])
    assert "teacher_tokenizer '/etc' is not a model directory" in " ".join(
        errors["teacher_tokenizer"]
    )
    allowed = SourceRules(
        model_roots=(str(tiny_model_dir.parent),), outbound_allow=("127.0.0.0/8",)
    )
    cfg = RunConfig.from_dict({**cfg.to_dict(), "teacher_tokenizer": str(tiny_model_dir)})
    assert config_source_errors(cfg, allowed) == {}


async def test_a_teacher_server_cannot_make_the_job_read_a_path_the_rules_refuse(
    torch_engine, tiny_model_dir
):
    """The engine reports its model's path; under rules that do not offer it, the job refuses
    to read it and asks for teacher_tokenizer instead."""
    from rl_core.sources import SourceRules

    teacher = SGLangTeacher(torch_engine.url)
    try:
        with pytest.raises(TeacherError, match="set teacher_tokenizer"):
            await verify_teacher(teacher, str(tiny_model_dir), rules=SourceRules())
    finally:
        await teacher.aclose()
