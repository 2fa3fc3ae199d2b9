"""The teacher top-k forward-KL term (rl_core.loss.topk_forward_kl), on values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rl_core.loss import topk_forward_kl

LN2 = math.log(2.0)
NEG_INF = float("-inf")


def _example():
    """Three sequences' worth of rows, k = 2. Row 0 is untrained. By hand, per trained row:
    row 1: p_T = (0.5, 0.25), p_S = (0.25, 0.25): 0.5 ln(0.5/0.25) + 0.25 ln 1 = 0.5 ln 2
    row 2: p_T = (0.8, pad),  p_S = (0.4, 0.1):  0.8 ln(0.8/0.4) = 0.8 ln 2 (padding weighs 0)
    row 3: as row 1: 0.5 ln 2."""
    log = math.log
    teacher = torch.tensor(
        [[-1.0, -2.0], [log(0.5), log(0.25)], [log(0.8), NEG_INF], [log(0.5), log(0.25)]]
    )
    student = torch.tensor(
        [[-3.0, -3.0], [log(0.25), log(0.25)], [log(0.4), log(0.1)], [log(0.25), log(0.25)]],
        requires_grad=True,
    )
    mask = torch.tensor([False, True, True, True])
    return student, teacher, mask


def test_the_term_is_the_teachers_probability_weighted_log_ratio_on_trained_tokens():
    student, teacher, mask = _example()
    loss, stats = topk_forward_kl(student, teacher, mask)
    assert_close(loss, torch.tensor(1.8 * LN2 / 3))
    assert stats["distill/topk_forward_kl"] == pytest.approx(0.6 * LN2)
    # The teacher's top-k mass: (0.75 + 0.8 + 0.75) / 3
    assert stats["distill/topk_teacher_mass"] == pytest.approx(2.3 / 3)


def test_its_gradient_raises_each_teacher_token_by_the_teachers_probability():
    """d loss / d log p_S(i) = -p_T(i) / n: padding and untrained rows get none."""
    student, teacher, mask = _example()
    loss, _ = topk_forward_kl(student, teacher, mask)
    loss.backward()
    want = -torch.tensor([[0.0, 0.0], [0.5, 0.25], [0.8, 0.0], [0.5, 0.25]]) / 3
    assert_close(student.grad, want)


def test_it_is_aggregated_as_the_ppo_loss_is():
    student, teacher, mask = _example()
    seq_ids = torch.tensor([0, 0, 0, 1])
    # token_mean over a whole minibatch's count: the sum over this call's tokens / normalizer
    loss, _ = topk_forward_kl(student, teacher, mask, normalizer=6.0)
    assert_close(loss, torch.tensor(1.8 * LN2 / 6))
    # seq_mean: each sequence's mean, averaged: ((0.5 + 0.8) / 2 + 0.5) / 2 ln 2
    loss, _ = topk_forward_kl(student, teacher, mask, seq_ids=seq_ids, loss_agg="seq_mean")
    assert_close(loss, torch.tensor(0.575 * LN2))


def test_a_student_equal_to_the_teacher_costs_nothing_and_no_trained_token_keeps_the_graph():
    teacher = torch.log(torch.tensor([[0.6, 0.3], [0.9, 0.05]]))
    student = teacher.clone().requires_grad_(True)
    loss, stats = topk_forward_kl(student, teacher, torch.tensor([False, True]))
    assert_close(loss, torch.tensor(0.0))
    assert stats["distill/topk_forward_kl"] == pytest.approx(0.0, abs=1e-7)
    loss, stats = topk_forward_kl(student, teacher, torch.tensor([False, False]))
    loss.backward()  # every rank still runs a backward
    assert stats == {} and loss.item() == 0.0
