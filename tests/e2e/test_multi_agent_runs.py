"""A multi-agent run end to end (issue 38): REST → Celery → Ray job → one adapter per role."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_training_runs import online_lora_run_played, run_state
from tests.livestack import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def lora_b_weights(adapter_dir: Path) -> dict:
    from safetensors.torch import load_file

    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    weights = {name: tensor for name, tensor in saved.items() if "lora_B" in name}
    assert weights, sorted(saved)
    return weights


def test_only_the_role_its_agents_play_is_trained_and_each_role_is_checkpointed(stack, rest):
    from webapp.gateway.models import Interaction
    from webapp.runs.models import MetricPoint

    # The agent asks for model "policy": its binding picks the speaker's adapter. The tiny
    # model never says "a"; a reward spread over the replies' characters gives each batch
    # unequal rewards (all equal would give zero advantages and no update to see).
    run, seen_versions, ended = online_lora_run_played(
        rest,
        stack,
        "game",
        agent_role="speaker",
        reward_of=lambda reply: sum(map(ord, reply)) % 7 / 6,
        roles=["speaker", "listener"],
    )
    wait_for(
        lambda: run_state(rest, run["id"])["status"] == "completed",
        240,
        f"the run to complete\n{stack.log_tail()}",
    )
    assert ended and len(seen_versions) > 1, seen_versions
    roles = set(
        Interaction.objects.filter(session__run_id=run["id"]).values_list("role", flat=True)
    )
    assert roles == {"speaker"}

    # Every step trained the speaker's trajectories and reported them under its role.
    names = set(MetricPoint.objects.filter(run_id=run["id"]).values_list("name", flat=True))
    steps = sorted(
        MetricPoint.objects.filter(run_id=run["id"], name="roles/speaker/reward").values_list(
            "step", flat=True
        )
    )
    assert steps == [1, 2, 3], steps
    assert "roles/speaker/ppo/loss" in names, sorted(names)
    assert not [n for n in names if n.startswith("roles/listener/")], sorted(names)

    # The checkpoint holds each role's adapter; only the speaker's moved from LoRA's
    # zero-initialised B (the listener got no gradient: AdamW leaves it exactly as it was).
    checkpoints = rest.get(f"/runs/{run['id']}/checkpoints/").json()["results"]
    final = Path(next(c["path"] for c in checkpoints if c["step"] == 3))
    speaker = lora_b_weights(final / "roles" / "speaker")
    listener = lora_b_weights(final / "roles" / "listener")
    assert set(speaker) == set(listener)
    assert all(not tensor.any() for tensor in listener.values())
    assert any(tensor.any() for tensor in speaker.values())
