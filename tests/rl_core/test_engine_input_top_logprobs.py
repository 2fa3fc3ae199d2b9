"""The torch engine's input top-k logprobs (SGLang's ``input_top_logprobs``, asked with
``top_logprobs_num`` beside ``logprob_start_len``): a distillation teacher's top-k, equal to a
plain full forward's."""

from __future__ import annotations

import httpx
import torch
from torch.testing import assert_close

from rl_core.distill import SGLangTeacher

IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]
K = 4


def _full_forward_top(reference, model_dir, ids: list[int]) -> torch.return_types.topk:
    with torch.no_grad():
        logits = reference.model(model_dir)(torch.tensor([ids])).logits[0, :-1]  # [L-1, V]
    return torch.log_softmax(logits.float(), dim=-1).topk(K, dim=-1)  # row t-1 → token t


def test_the_engine_returns_each_input_tokens_top_k_as_a_full_forward_does(
    torch_engine, tiny_model_dir, reference
):
    body = {
        "input_ids": IDS,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": K,
    }
    meta = httpx.post(f"{torch_engine.url}/generate", json=body, timeout=60).json()["meta_info"]
    rows = meta["input_top_logprobs"]
    assert len(rows) == len(IDS) - 3 == len(meta["input_token_logprobs"])
    want = _full_forward_top(reference, tiny_model_dir, IDS)
    for t, row in zip(range(3, len(IDS)), rows, strict=True):
        assert [e[1] for e in row] == want.indices[t - 1].tolist()  # best first
        assert_close(torch.tensor([e[0] for e in row]), want.values[t - 1], atol=1e-4, rtol=0)
    # From the first token on, that token has no prediction: None, as SGLang answers.
    body["logprob_start_len"] = 0
    meta = httpx.post(f"{torch_engine.url}/generate", json=body, timeout=60).json()["meta_info"]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(IDS)


async def test_an_sglang_teacher_reads_them_with_its_own_tokens_logprobs(
    torch_engine, tiny_model_dir, reference
):
    teacher = SGLangTeacher(torch_engine.url)
    try:
        got = await teacher.top_logprobs(IDS, K)
        assert got.logprobs == await teacher.logprobs(IDS)
    finally:
        await teacher.aclose()
    want = _full_forward_top(reference, tiny_model_dir, IDS)
    assert len(got.ids) == len(got.topk_logprobs) == len(IDS)
    assert got.ids[0] == [0] * K and got.topk_logprobs[0] == [float("-inf")] * K  # padding
    assert got.ids[1:] == want.indices.tolist()
    assert_close(torch.tensor(got.topk_logprobs[1:]), want.values, atol=1e-4, rtol=0)
