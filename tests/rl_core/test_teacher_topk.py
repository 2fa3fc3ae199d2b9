"""Teachers' top-k by API (rl_core.distill, rl_core.distill_topk), against servers answering as
vLLM and OpenAI-compatible servers do; a teacher that cannot is refused, saying which can."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from rl_core.config import ConfigError, RunConfig
from rl_core.distill import (
    OpenAITeacher,
    TeacherScorer,
    TeacherUnsupported,
    VLLMTeacher,
)
from rl_core.distill_topk import PAD_LOGPROB, TOPK_IDS, TOPK_LOGPROBS, TeacherTopK, topk_extras
from rl_core.types import Trajectory

IDS = [7, 8, 9]


def _client(answer: dict, seen: list | None = None) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx.Response(200, json=answer)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_a_vllm_teacher_keeps_the_top_k_by_rank_not_the_token_itself():
    """vLLM's prompt_logprobs hold the top k and the prompt token (rank k+1 here)."""
    rows = [
        None,
        {"8": {"logprob": -3.0, "rank": 3}, "1": {"logprob": -0.5, "rank": 1},
         "2": {"logprob": -1.0, "rank": 2}},
        {"9": {"logprob": -0.1, "rank": 1}, "4": {"logprob": -2.5, "rank": 2}},
    ]  # fmt: skip
    seen: list = []
    teacher = VLLMTeacher("http://vllm", http=_client({"prompt_logprobs": rows}, seen))
    got = await teacher.top_logprobs(IDS, 2)
    assert seen[0]["sampling_params"]["prompt_logprobs"] == 2
    assert got.logprobs == [0.0, -3.0, -0.1]
    assert got.ids == [[0, 0], [1, 2], [9, 4]]
    assert got.topk_logprobs == [[PAD_LOGPROB] * 2, [-0.5, -1.0], [-0.1, -2.5]]


async def test_an_openai_teacher_reads_top_k_named_by_token_id():
    logprobs = {
        "token_logprobs": [None, -2.0, -0.3, -1.0],
        "top_logprobs": [None, {"token_id:5": -0.2, "token_id:8": -2.0}, {"token_id:9": -0.3}],
    }
    seen: list = []
    answer = {"choices": [{"logprobs": logprobs}]}
    teacher = OpenAITeacher("http://oai/v1", model="m", http=_client(answer, seen))
    got = await teacher.top_logprobs(IDS, 2)
    assert seen[0]["logprobs"] == 2 and seen[0]["return_tokens_as_token_ids"] is True
    assert got.ids == [[0, 0], [5, 8], [9, 0]]  # a short row is padded
    assert got.topk_logprobs[2] == [-0.3, PAD_LOGPROB]


async def test_a_teacher_that_names_its_top_k_by_text_is_refused_saying_which_apis_can():
    logprobs = {
        "token_logprobs": [None, -2.0, -0.3],
        "top_logprobs": [None, {" the": -0.2}, {" cat": -0.3}],
    }
    teacher = OpenAITeacher(
        "http://oai/v1", model="m", http=_client({"choices": [{"logprobs": logprobs}]})
    )
    with pytest.raises(TeacherUnsupported) as refused:
        await teacher.top_logprobs(IDS, 2)
    message = str(refused.value)
    assert "by text" in message and "teacher_api sglang" in message and "vllm" in message
    assert "set distill_topk to 0" in message


async def test_the_scorer_sets_each_trajectorys_top_k_and_does_not_retry_an_unsupported_teacher():
    class _Teacher:
        name = "fake"
        calls = 0

        async def top_logprobs(self, input_ids, k, adapter=None):
            self.calls += 1
            n = len(input_ids)
            return TeacherTopK([0.0] + [-1.0] * (n - 1), [[3] * k] * n, [[-0.5] * k] * n)

        async def aclose(self):
            pass

    traj = Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0], [1.0])
    teacher = _Teacher()
    await TeacherScorer(teacher, topk=2).score([traj])  # type: ignore[arg-type]
    assert traj.teacher_logprobs == [0.0, -1.0, -1.0]
    assert traj.teacher_topk_ids == [[3, 3]] * 3 and traj.teacher_topk_logprobs == [[-0.5] * 2] * 3

    class _Unsupported(_Teacher):
        async def top_logprobs(self, input_ids, k, adapter=None):
            self.calls += 1
            raise TeacherUnsupported("no top-k here")

    unsupported = _Unsupported()
    with pytest.raises(TeacherUnsupported, match="no top-k here"):
        await TeacherScorer(unsupported, topk=2, backoff_s=0.0).score([traj])  # type: ignore[arg-type]
    assert unsupported.calls == 1


def test_a_hints_positions_leave_the_top_k_rows_as_they_leave_the_logprobs():
    got = TeacherTopK(
        [0.0, -1.0, -2.0, -3.0], [[1], [2], [3], [4]], [[-0.1], [-0.2], [-0.3], [-0.4]]
    )
    out = got.without(at=1, length=2)  # the hint was tokens 1-2
    assert out.logprobs == [0.0, -3.0] and out.ids == [[0], [4]]
    assert out.topk_logprobs == [[PAD_LOGPROB], [-0.4]]
    first = got.without(at=0, length=1)  # a hint before everything: the new first row is padding
    assert first.logprobs[0] == 0.0 and first.ids[0] == [0]


def test_the_trainers_extras_pad_untrained_positions_and_unscored_trajectories():
    scored = Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0], [1.0])
    scored.teacher_topk_ids = [[5, 6], [7, 8], [9, 10]]
    scored.teacher_topk_logprobs = [[-1.0, -2.0]] * 3
    unscored = Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], [1.0])
    extras = topk_extras([scored, unscored])
    assert extras[TOPK_IDS][0].tolist() == [[0, 0], [7, 8], [9, 10]]
    assert extras[TOPK_LOGPROBS][0][0].tolist() == [PAD_LOGPROB] * 2
    assert extras[TOPK_IDS][1].tolist() == [[0, 0], [0, 0]]
    assert torch.isinf(extras[TOPK_LOGPROBS][1]).all()
    assert topk_extras([unscored]) == {}


def test_distill_topk_needs_a_teacher_and_stays_within_64():
    base = {"base_model": "m", "mode": "online"}
    with pytest.raises(ConfigError) as bad:
        RunConfig.from_dict({**base, "distill_topk": 8})
    assert "needs a teacher" in " ".join(bad.value.errors["distill_topk"])
    teacher = {**base, "teacher_url": "http://127.0.0.1:1"}
    with pytest.raises(ConfigError) as bad:
        RunConfig.from_dict({**teacher, "distill_topk": 65})
    assert "distill_topk" in bad.value.errors
    # The top-k term alone trains: both weights 0 is then allowed.
    alone = {**teacher, "distill_topk": 8, "distill_weight": 0.0, "reward_weight": 0.0}
    assert RunConfig.from_dict(alone).distill_topk == 8
