"""Self-distillation from feedback (issue 38): a person's comment becomes the hint a
self-distilling run's teacher (the policy, served by a real torch engine) reads in context, and
changes the per-token signal of that session only; the session page shows both."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.testing import assert_close

from rl_core.distill import SGLangTeacher, TeacherScorer, distill_advantages
from rl_core.hints import HintPlacement, unhinted
from rl_core.types import Trajectory
from webapp.gateway.models import Session
from webapp.runs.jobs import job_claim_trajectories, job_secret_issue

pytestmark = pytest.mark.django_db

TURNS = [{"messages": [{"role": "user", "content": "What is 2+2?"}], "answer": "It is 5."}]
COMMENT = "Add correctly: 2+2 is 4."


@pytest.fixture
def self_distilling(project, make_run, set_status):
    run = make_run(project, self_distill=True, reward_weight=0.0, hint_template="Note: {hint}")
    return set_status(run, "running")


def _score(engine_url: str, placement: HintPlacement, trajectories: list[Trajectory]):
    received: dict[str, dict] = {}

    async def keep(signals: dict[str, dict]) -> None:
        received.update(signals)

    async def go() -> dict[str, float]:
        scorer = TeacherScorer(SGLangTeacher(engine_url), hints=placement, on_signals=keep)
        try:
            return await scorer.score(trajectories)
        finally:
            await scorer.aclose()

    return asyncio.run(go()), received


def test_a_feedback_comment_changes_the_teacher_context_and_signal_of_that_session_only(
    api,
    client,
    member_client,
    self_distilling,
    make_agent,
    make_session,
    chat_tokenizer,
    torch_engine,
    tiny_model_dir,
    reference,
):
    agent = make_agent(self_distilling.project, run=self_distilling)
    hinted, plain = make_session(agent, TURNS), make_session(agent, TURNS)
    response = api.post(
        f"/api/v1/sessions/{hinted.id}/feedback/", {"comment": COMMENT}, format="json"
    )
    assert response.status_code == 201, response.content
    assert Session.objects.get(pk=hinted.pk).hint == COMMENT
    assert Session.objects.get(pk=plain.pk).hint == ""

    claimed = {c["session_id"]: c for c in job_claim_trajectories(run=self_distilling, limit=8)}
    [mine] = [Trajectory.from_dict(t) for t in claimed[str(hinted.id)]["trajectories"]]
    [theirs] = [Trajectory.from_dict(t) for t in claimed[str(plain.id)]["trajectories"]]
    assert mine.input_ids == theirs.input_ids and mine.metadata["hint"] == COMMENT
    assert "hint" not in theirs.metadata

    placement = HintPlacement(chat_tokenizer, "system", "Note: {hint}")
    metrics, signals = _score(torch_engine.url, placement, [mine, theirs])

    # The teacher read the hinted session with the note as a system message before it.
    context, at, length = placement.hinted(mine)
    note = chat_tokenizer.render(
        [{"role": "system", "content": f"Note: {COMMENT}"}], add_generation_prompt=False
    )
    assert context[at : at + length] == chat_tokenizer.encode(note) and at == 0
    with_hint = reference.logprobs(tiny_model_dir, context[:1], context[1:]).tolist()
    trained = torch.tensor(mine.loss_mask, dtype=torch.bool)
    want = torch.tensor(unhinted([0.0, *with_hint], at, length))
    assert_close(torch.tensor(mine.teacher_logprobs)[trained], want[trained], atol=1e-4, rtol=0)
    # ... which is not what the policy says without the hint: the hint changed the signal.
    without = reference.logprobs(tiny_model_dir, mine.input_ids[:1], mine.input_ids[1:])
    bare = torch.tensor([0.0, *without.tolist()])
    assert (want[trained] - bare[trained]).abs().max() > 1e-3
    # The session without a hint is not scored: it trains on its reward alone (weight 0 here).
    assert theirs.teacher_logprobs is None
    assert metrics["distill/hinted_trajectories"] == 1.0
    assert metrics["distill/teacher_tokens"] == len(context)
    advantages = distill_advantages([mine, theirs], [torch.ones(len(mine.input_ids))] * 2, 0.0, 1.0)
    assert not advantages[1].any() and advantages[0][trained].abs().min() > 0

    # What the hint did goes back to the web app (the job's internal API), for that session only.
    assert set(signals) == {str(hinted.id)}
    [part] = signals[str(hinted.id)]["trajectories"]
    assert part["tokens"] == [t for t, m in zip(mine.input_ids, mine.loss_mask, strict=True) if m]
    expected = (torch.tensor(mine.teacher_logprobs) - torch.tensor(mine.logprobs))[trained]
    assert part["signal"] == [round(v, 4) for v in expected.tolist()]
    secret = job_secret_issue(run=self_distilling)
    stored = client.post(
        f"/internal/v1/runs/{self_distilling.id}/hint_signals",
        data={"sessions": signals},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    assert stored.status_code == 200 and stored.json() == {"updated": 1}
    assert Session.objects.get(pk=plain.pk).hint_signal is None

    page = member_client.get(f"/projects/{agent.project_id}/sessions/{hinted.id}/").content.decode()
    assert 'id="session-hint"' in page and COMMENT in page
    assert page.count("data-signal=") == len(part["tokens"])
    assert "sigup" in page or "sigdown" in page
    other = member_client.get(f"/projects/{agent.project_id}/sessions/{plain.id}/").content.decode()
    assert 'id="session-hint"' not in other


def test_hint_signals_from_the_job_are_checked_and_kept_to_its_own_run(
    client, self_distilling, project, make_run, make_agent, make_session
):
    other_run = make_run(project, name="other")
    foreign = make_session(make_agent(project, name="other", run=other_run), TURNS)
    secret = job_secret_issue(run=self_distilling)

    def post(body):
        return client.post(
            f"/internal/v1/runs/{self_distilling.id}/hint_signals",
            data=body,
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {secret}",
        )

    good = {"hint": "h", "trajectories": [{"tokens": [1, 2], "signal": [0.5, -0.5]}]}
    assert post({"sessions": {str(foreign.id): good}}).json() == {"updated": 0}
    assert Session.objects.get(pk=foreign.pk).hint_signal is None
    for bad in (
        {"sessions": []},
        {"sessions": {"not-an-id": good}},
        {"sessions": {str(foreign.id): {"trajectories": [{"tokens": [1], "signal": []}]}}},
        {"sessions": {str(foreign.id): {"trajectories": [{"tokens": ["a"], "signal": [1]}]}}},
    ):
        assert post(bad).status_code == 400, bad
