"""``/rl/set_reward``'s ``hint``: a correction in words kept on the session for a self-distilling
run's teacher (rl_core.hints), until its trajectory goes to training."""

from __future__ import annotations

import pytest

from webapp.gateway.models import Session
from webapp.runs import jobs

pytestmark = pytest.mark.django_db(transaction=True)


def _one_turn(gw, key: str) -> None:
    gw.openai(key).chat.completions.create(
        model=gw.model, messages=[{"role": "user", "content": "Say a."}], max_tokens=3
    )


def test_a_hint_is_kept_with_the_reward_and_replaced_until_training(gw):
    session_id, key = gw.start_session()
    _one_turn(gw, key)
    answer = gw.post("/rl/set_reward", {"reward": 0.0, "hint": "Answer with one letter."}, key=key)
    assert answer.status_code == 200, answer.text
    assert answer.json()["hint"] == "Answer with one letter."
    assert Session.objects.get(pk=session_id).hint == "Answer with one letter."
    # The same reward again with a better hint: the hint changes, the reward stays.
    again = gw.post("/rl/set_reward", {"reward": 0.0, "hint": "Say just: a"}, key=key)
    assert again.status_code == 200 and again.json()["reward"] == 0.0
    assert Session.objects.get(pk=session_id).hint == "Say just: a"
    # Another session of the same agent keeps no hint of this one's.
    other_id, other_key = gw.start_session()
    _one_turn(gw, other_key)
    assert gw.post("/rl/set_reward", {"reward": 1.0}, key=other_key).status_code == 200
    assert Session.objects.get(pk=other_id).hint == ""
    assert gw.post("/rl/end_session", {}, key=other_key).status_code == 200


def test_the_hint_travels_with_the_claimed_trajectory(gw):
    session_id, key = gw.start_session()
    _one_turn(gw, key)
    assert (
        gw.post("/rl/set_reward", {"reward": 0.5, "hint": "Be brief."}, key=key).status_code == 200
    )
    assert gw.post("/rl/end_session", {}, key=key).status_code == 200
    [claimed] = jobs.job_claim_trajectories(run=gw.run, limit=4)
    assert claimed["session_id"] == str(session_id)
    assert [t["metadata"]["hint"] for t in claimed["trajectories"]] == ["Be brief."]
