"""On-policy distillation through the real job path (issue 38): REST → Celery → Ray job, whose
loop has a teacher (a torch engine this test serves) score every batch before its step.

The teacher is the tiny model after RL on the toy task (``tests/distill_teacher.py``); the
student learns from its per-token signal alone. A teacher whose tokenizer is not the student's
fails the run before anything trains, naming both.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from rl_core.toy import TOY_SETTINGS
from tests.e2e.test_training_runs import create_dataset_run, run_state
from tests.livestack import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

STEPS = 10


@pytest.fixture(scope="module")
def teacher(stack, tmp_path_factory):
    """``(url, model dir)`` of a torch engine serving a teacher good at the toy task."""
    from rl_core.inference.launch import TorchEngineServer
    from tests.distill_teacher import rl_teacher

    base = tmp_path_factory.mktemp("teacher")
    servers = []

    def serve(path):
        server = TorchEngineServer(path, host="127.0.0.1", num_threads=1, weight_version=0)
        servers.append(server)
        server.start()
        server.wait_healthy(timeout=120)
        return server.url

    try:
        model_dir, rewards = asyncio.run(
            rl_teacher(stack.model_dir, serve(stack.model_dir), base / "model")
        )
        assert sum(rewards[-3:]) / 3 > 0.6, rewards
        yield serve(model_dir), model_dir
    finally:
        for server in servers:
            server.stop()


def test_a_dataset_run_distilled_from_a_teacher_learns_and_its_reverse_kl_falls(
    stack, rest, teacher
):
    from webapp.runs.models import MetricPoint

    url, _ = teacher
    run = create_dataset_run(
        rest,
        stack,
        max_steps=STEPS,
        save_every=STEPS,
        teacher_url=url,
        reward_weight=0.0,  # the teacher's signal alone
    )
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, run["id"])["status"] in ("completed", "failed"),
        600,
        f"the distillation run to complete\n{stack.log_tail()}",
    )
    final = run_state(rest, run["id"])
    assert final["status"] == "completed", final.get("error")

    def series(name: str) -> list[float]:
        points = MetricPoint.objects.filter(run_id=run["id"], name=name).order_by("step")
        return [p.value for p in points]

    batch = TOY_SETTINGS["batch_size"]
    # The teacher scored every trajectory of every step, every one of its tokens.
    assert series("distill/teacher_calls") == [float(batch)] * STEPS
    assert min(series("distill/teacher_tokens")) > batch * 8
    kl, rewards = series("distill/reverse_kl"), series("rollout/reward")
    # (The job's rollouts run ahead of training, so the first steps train on answers of the
    # untrained student: the fall starts after a few steps.)
    assert min(kl[-3:]) < kl[0] / 4 and sum(kl[-3:]) / 3 < kl[0] / 2, kl
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.3, (rewards, kl)


def test_a_teacher_with_another_tokenizer_fails_the_run_naming_both(stack, rest, teacher, tmp_path):
    from transformers import AutoTokenizer

    url, model_dir = teacher
    other = model_dir.parent / "other-tokenizer"
    shutil.copytree(model_dir, other, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(other)
    run = create_dataset_run(
        rest, stack, max_steps=STEPS, teacher_url=url, teacher_tokenizer=str(other)
    )
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, run["id"])["status"] in ("completed", "failed"),
        300,
        f"the run to fail\n{stack.log_tail()}",
    )
    final = run_state(rest, run["id"])
    assert final["status"] == "failed"
    assert "must share one tokenizer" in final["error"]
    assert str(other) in final["error"] and str(stack.model_dir) in final["error"]
    assert "Traceback" not in final["error"]  # the message says all there is to say


def test_an_online_lora_run_self_distils_from_the_hints_its_agents_send(stack, rest):
    """The policy is its own teacher (self_distill): the job scores each session that came with
    a hint under the current adapter, with the hint in context, and tells the web app what the
    hint did to each token; sessions without one train on their reward alone."""
    from tests.e2e.test_training_runs import online_lora_run_played
    from webapp.gateway.models import Session
    from webapp.runs.models import MetricPoint

    hint = "The answer is the letter a."
    run, _, ended = online_lora_run_played(rest, stack, "self distil", hint=hint, self_distill=True)
    wait_for(
        lambda: run_state(rest, run["id"])["status"] in ("completed", "failed"),
        240,
        f"the run to complete\n{stack.log_tail()}",
    )
    final = run_state(rest, run["id"])
    assert final["status"] == "completed", final.get("error")
    hinted = MetricPoint.objects.filter(run_id=run["id"], name="distill/hinted_trajectories")
    assert hinted.count() == 3 and sum(p.value for p in hinted) > 0
    trained = Session.objects.filter(run_id=run["id"], trajectory=Session.Trajectory.TRAINED)
    with_hint = trained.exclude(hint="")
    assert with_hint.exists() and all(s.hint == hint for s in with_hint)
    for session in with_hint:  # what the hint did, per trained token, kept for its page
        [part] = session.hint_signal["trajectories"]
        assert len(part["tokens"]) == len(part["signal"]) > 0
    assert not trained.filter(hint="").exclude(hint_signal=None).exists()
    assert set(str(s.pk) for s in trained) <= set(ended)
