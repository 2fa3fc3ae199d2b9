"""Where self-distillation puts a session's hint in the teacher's context (rl_core.hints), and
the settings that ask for it."""

from __future__ import annotations

import pytest

from rl_core.chat import ChatTokenizer
from rl_core.config import ConfigError, RunConfig
from rl_core.hints import HintPlacement, signal_of, unhinted
from rl_core.types import Trajectory


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(tiny_model_dir)


def _traj(tok: ChatTokenizer, hint: str | None) -> Trajectory:
    prompt = tok.encode(tok.render([{"role": "user", "content": "Say a."}]))
    answer = tok.encode("b")
    return Trajectory(
        prompt + answer,
        [0] * len(prompt) + [1] * len(answer),
        [0.0] * len(prompt) + [-1.0] * len(answer),
        [-1] * len(prompt) + [0] * len(answer),
        [0.0],
        metadata={"hint": hint} if hint is not None else {},
    )


def test_a_system_note_goes_before_the_conversation_in_the_templates_words(tok):
    traj = _traj(tok, "Say a, not b.")
    ids, at, length = HintPlacement(tok, "system", "Note: {hint}").hinted(traj)
    note = tok.render(
        [{"role": "system", "content": "Note: Say a, not b."}], add_generation_prompt=False
    )
    assert at == 0 and ids[:length] == tok.encode(note) and ids[length:] == traj.input_ids


def test_before_response_puts_plain_text_right_before_the_first_answer_token(tok):
    traj = _traj(tok, "Say a.")
    ids, at, length = HintPlacement(tok, "before_response", "({hint})").hinted(traj)
    assert at == traj.loss_mask.index(1)
    assert ids[at : at + length] == tok.encode("(Say a.)\n\n")
    assert ids[:at] + ids[at + length :] == traj.input_ids


def test_no_hint_no_context_and_scores_map_back_to_the_original_tokens(tok):
    assert HintPlacement(tok).hinted(_traj(tok, None)) is None
    assert HintPlacement(tok).hinted(_traj(tok, "  ")) is None
    # Five original tokens, a two-token note at 2: the note's scores are left out.
    assert unhinted([9.0, -1.0, -7.0, -7.0, -2.0, -3.0, -4.0], 2, 2) == [
        0.0,
        -1.0,
        -2.0,
        -3.0,
        -4.0,
    ]


def test_the_signal_kept_for_the_page_is_per_trained_token(tok):
    traj = _traj(tok, "h")
    traj.teacher_logprobs = [0.0] * (len(traj.input_ids) - 1) + [-0.25]
    assert signal_of(traj) == {"tokens": [traj.input_ids[-1]], "signal": [0.75]}


def test_self_distill_settings_are_checked():
    base = {"base_model": "m", "mode": "online", "self_distill": True}
    assert RunConfig.from_dict(base).hint_position == "system"
    for bad, field in (
        ({"teacher_url": "http://127.0.0.1:1"}, "self_distill"),
        ({"hint_template": "no placeholder"}, "hint_template"),
        ({"hint_position": "middle"}, "hint_position"),
        ({"distill_weight": 0.0, "reward_weight": 0.0}, "distill_weight"),
    ):
        with pytest.raises(ConfigError) as refused:
            RunConfig.from_dict({**base, **bad})
        assert field in refused.value.errors, bad
