"""A long session recorded through the gateway while the policy moves on: at training time its
turns older than the staleness bound are context, its fresh turns are trained."""

from __future__ import annotations

import pytest

from rl_core.staleness import mask_stale
from webapp.gateway.models import Session
from webapp.gateway.selectors import session_trajectories

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_six_turn_session_over_three_versions_trains_its_fresh_turns_only(
    gw, engine, load_weights, tiny_model_dir, perturbed_model_dir
):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    messages: list = [{"role": "user", "content": "Hi"}]
    fingerprints = []
    try:
        for turn in range(6):
            if turn in (2, 4):  # the trainer published a step between these turns
                load_weights(engine, perturbed_model_dir, turn // 2)
            completion = client.chat.completions.create(
                model=gw.model, messages=messages, max_tokens=4, seed=turn
            )
            fingerprints.append(completion.system_fingerprint)
            messages += [
                {"role": "assistant", "content": completion.choices[0].message.content},
                {"role": "user", "content": f"And {turn}?"},
            ]
    finally:
        load_weights(engine, tiny_model_dir, 0)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    gw.post("/rl/end_session", key=key)
    assert fingerprints == ["steep-v0", "steep-v0", "steep-v1", "steep-v1", "steep-v2", "steep-v2"]

    [trajectory] = session_trajectories(Session.objects.get(pk=session_id))
    trained, masked = mask_stale(trajectory, train_version=2, max_staleness=1)

    spans = trajectory.turn_spans()
    assert len(spans) == 6
    turn_versions = [
        {v for v, m in zip(trajectory.versions[a:b], trajectory.loss_mask[a:b], strict=True) if m}
        for a, b in spans
    ]
    assert turn_versions == [{0}, {0}, {1}, {1}, {2}, {2}]
    in_loss = [any(trained.loss_mask[a:b]) for a, b in spans]
    assert in_loss == [False, False, True, True, True, True]
    assert masked == sum(trajectory.loss_mask[spans[0][0] : spans[1][1]])
    assert trained.input_ids == trajectory.input_ids and trained.rewards == trajectory.rewards
