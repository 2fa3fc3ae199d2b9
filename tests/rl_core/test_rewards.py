import threading

import pytest

from rl_core.rewards import (
    exact_match_reward_fn,
    load_reward_fn,
    math_reward_fn,
    regex_reward_fn,
    score,
)


def length_reward_fn(prompt, completion, answer, metadata):
    """A user reward function, referenced by dotted path in the tests below."""
    return len(completion) / metadata.get("max_len", 10)


def broken_reward_fn(prompt, completion, answer, metadata):
    raise KeyError("expected_key")


def nan_reward_fn(prompt, completion, answer, metadata):
    return float("nan")


def test_exact_match_ignores_surrounding_whitespace_only():
    assert exact_match_reward_fn("q", "  Paris \n", "Paris", {}) == 1.0
    assert exact_match_reward_fn("q", "New  York", "New York", {}) == 1.0
    assert exact_match_reward_fn("q", "paris", "Paris", {}) == 0.0
    assert exact_match_reward_fn("q", "7", 7, {}) == 1.0


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("The result: \\boxed{42}", "42", 1.0),
        ("The result: \\boxed{41}", "42", 0.0),
        ("I do not know", "42", 0.0),
    ],
)
def test_math_reward_checks_equivalence(completion, answer, expected):
    assert math_reward_fn("q", completion, answer, {}) == expected


def test_math_reward_works_off_the_main_thread():
    result = []
    thread = threading.Thread(
        target=lambda: result.append(math_reward_fn("q", "\\boxed{3}", "3", {}))
    )
    thread.start()
    thread.join()
    assert result == [1.0]


def test_regex_reward_without_answer_group_rewards_any_match():
    assert (
        regex_reward_fn("q", "<think>x</think> done", None, {}, pattern=r"^<think>.*</think>")
        == 1.0
    )
    assert regex_reward_fn("q", "done", None, {}, pattern=r"^<think>") == 0.0
    assert regex_reward_fn("q", "DONE", None, {}, pattern=r"done", flags="i") == 1.0


def test_regex_answer_group_must_equal_the_answer_in_the_last_match():
    fn = load_reward_fn({"type": "regex", "pattern": r"####\s*(?P<answer>-?\d+)"})
    assert fn("q", "first #### 3 then #### 12", "12", {}) == 1.0
    assert fn("q", "#### 12 then #### 3", "12", {}) == 0.0


def test_builtin_rewards_load_by_name():
    assert load_reward_fn({"type": "exact_match"}) is exact_match_reward_fn
    assert load_reward_fn("math") is math_reward_fn


def test_user_function_loads_by_dotted_path():
    fn = load_reward_fn({"type": "python", "path": f"{__name__}:length_reward_fn"})
    assert fn is length_reward_fn
    assert score(fn, "q", "abcde", None, {"max_len": 20}) == (0.25, None)
    assert load_reward_fn(f"{__name__}:length_reward_fn") is length_reward_fn


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "python", "path": "no_such_module_xyz:fn"}, "No module named"),
        ({"type": "python", "path": f"{__name__}:missing"}, "does not name a function"),
        ({"type": "python", "path": "just_a_module"}, "module:function"),
        ({"type": "regex", "pattern": "x", "flags": "q"}, "unknown regex flag"),
        ({"type": "bleu"}, "unknown reward type"),
    ],
)
def test_bad_specs_fail_at_load_time(spec, message):
    with pytest.raises((ValueError, ImportError), match=message):
        load_reward_fn(spec)


def test_a_raising_reward_function_is_recorded_not_raised():
    reward, error = score(broken_reward_fn, "q", "a")
    assert reward == 0.0
    assert error == "KeyError: 'expected_key'"


def test_a_non_finite_reward_is_an_error():
    reward, error = score(nan_reward_fn, "q", "a")
    assert reward == 0.0
    assert "not a finite number" in error


def test_builtin_errors_are_recorded_too():
    assert (
        score(exact_match_reward_fn, "q", "a", None)[1]
        == "ValueError: exact_match needs an 'answer' in every dataset row"
    )


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("a", "a", 1.0),
        (" v\n", "v", 1.0),
        ("aaaaaaaa", "a", 0.75),
        ("vvvvvvvv", "a", -0.1),  # the other demo letter costs
        ("aaaavvvv", "a", 0.375 - 0.05),
        ("xyzzyxzy", "v", 0.0),
        ("", "v", 0.0),
    ],
)
def test_the_demo_task_rewards_the_asked_letter_and_penalises_the_other(
    completion, answer, expected
):
    from rl_core.toy import say_the_asked_letter_reward_fn

    assert say_the_asked_letter_reward_fn("Say it.", completion, answer) == pytest.approx(expected)


def test_the_demo_rows_ask_for_both_letters_in_every_phrasing():
    from rl_core.toy import DEMO_LETTERS, PHRASINGS, demo_rows

    rows = demo_rows(512, seed=0)
    assert rows == demo_rows(512, seed=0)  # seeded
    assert {row["answer"] for row in rows} == set(DEMO_LETTERS)
    for row in rows:
        assert row["prompt"] in {p.format(letter=row["answer"]) for p in PHRASINGS}


@pytest.mark.parametrize(
    "word, shown",
    [("vvvvvvvv", "v"), ("vaaa", "a"), ("Have a", "a"), ("va", None), ("xyz", None), ("", None)],
)
def test_the_games_shown_letter_is_the_majority_game_letter_or_none(word, shown):
    from rl_core.toy import shown_letter

    assert shown_letter(word) == shown


def test_the_speakers_wordings_differ_only_in_the_target():
    from rl_core.toy import SPEAKER_PHRASINGS, speaker_prompt

    assert speaker_prompt("v") == "Target: v. Say one word that tells it."
    assert len({speaker_prompt("v", p) for p in SPEAKER_PHRASINGS}) == len(SPEAKER_PHRASINGS) > 1
    for phrasing in SPEAKER_PHRASINGS:
        v, a = speaker_prompt("v", phrasing), speaker_prompt("a", phrasing)
        assert len(v) == len(a)
        assert [(x, y) for x, y in zip(v, a, strict=True) if x != y] == [("v", "a")]
