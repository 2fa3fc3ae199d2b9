"""The torch engine's prefix cache (issue 36): a session's next turn prefills only what it added,
and what it samples is what a full prefill samples."""

from __future__ import annotations

import httpx
import pytest
import torch

from rl_core.inference.torch_engine.prefix_cache import PrefixCache, common_prefix

PROMPT = [65 + (i * 7) % 26 for i in range(40)]  # 40 byte tokens


def _kv(ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer whose keys at each position hold that position's token id."""
    keys = torch.tensor(ids, dtype=torch.float32).reshape(1, 1, len(ids), 1)
    return [(keys, -keys)]


def test_common_prefix_lengths():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([5], [6]) == 0
    assert common_prefix(list(range(1000)), [*range(637), -1]) == 637
    assert common_prefix([], [1]) == 0


def test_the_longest_prefix_of_the_same_adapter_is_taken_and_the_last_token_computed():
    cache = PrefixCache(max_bytes=800, min_reuse=4)
    cache.put(None, [1, 2, 3, 4, 5, 6], _kv([1, 2, 3, 4, 5, 6]))
    cache.put(None, [1, 2, 3, 9, 9, 9, 9, 9], _kv([1, 2, 3, 9, 9, 9, 9, 9]))
    cache.put("run-v1", [1, 2, 3, 4, 5, 6, 7, 8], _kv([1, 2, 3, 4, 5, 6, 7, 8]))

    length, kv = cache.match(None, [1, 2, 3, 4, 5, 6, 7, 8])
    assert length == 6 and kv[0][0].flatten().tolist() == [1, 2, 3, 4, 5, 6]
    assert torch.equal(kv[0][1], -kv[0][0])
    # The whole prompt cached: its last token is still computed (its logits pick the answer).
    length, kv = cache.match(None, [1, 2, 3, 4, 5, 6])
    assert length == 5 and kv[0][0].shape[2] == 5
    length, _ = cache.match("run-v1", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    assert length == 8
    assert cache.match("run-v2", [1, 2, 3, 4, 5, 6, 7]) is None
    assert cache.match(None, [1, 2, 3, 7, 7, 7]) is None  # 3 tokens shared: under min_reuse
    assert (cache.hits, cache.cached_tokens) == (3, 19)


def test_an_entry_the_next_turn_extends_is_replaced_and_the_budget_holds():
    cache = PrefixCache(max_bytes=20 * 8, min_reuse=2)  # 20 tokens of _kv's (8 bytes each)
    cache.put(None, [1, 2, 3, 4], _kv([1, 2, 3, 4]))
    cache.put(None, [1, 2, 3, 4, 5, 6], _kv([1, 2, 3, 4, 5, 6]))  # the next turn of the same
    assert (len(cache), cache.tokens, cache.bytes) == (1, 6, 48)
    cache.put(None, [7, 8, 9, 10, 11, 12, 13, 14], _kv([7] * 8))
    cache.put(None, [20, 21, 22, 23, 24, 25, 26, 27], _kv([20] * 8))  # 22 tokens: oldest out
    assert (len(cache), cache.tokens) == (2, 16)
    assert cache.match(None, [1, 2, 3, 4, 5, 6, 0]) is None
    assert cache.match(None, [7, 8, 9, 10, 0])[0] == 4
    cache.put(None, list(range(30, 51)), _kv(list(range(30, 51))))  # over the budget: not kept
    assert cache.tokens == 16
    epoch = cache.epoch
    cache.clear()
    assert (len(cache), cache.tokens, cache.bytes, cache.epoch) == (0, 0, 0, epoch + 1)


async def _generate(url: str, input_ids: list[int], **params) -> dict:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, **params},
        "return_logprob": True,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(url + "/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def _info(url: str) -> dict:
    async with httpx.AsyncClient(timeout=60) as http:
        return (await http.get(url + "/server_info")).json()["internal_states"][0]


@pytest.fixture(scope="module")
def engines(torch_engine_factory):
    """A server with the prefix cache (the default) and one without (SGLang's flag)."""
    return torch_engine_factory(weight_version=0), torch_engine_factory(
        weight_version=0, extra_args=["--disable-radix-cache"]
    )


async def test_a_next_turn_prefills_only_what_it_added_and_answers_as_a_full_prefill(engines):
    cached, plain = engines
    first = await _generate(cached.url, PROMPT)
    assert first["meta_info"]["cached_tokens"] == 0
    before, answer = PROMPT, first["output_ids"]
    for _ in range(3):  # a session of several turns: each reuses the last one's KV
        turn = before + answer + [10, *range(97, 117)]  # the answer, then a new message
        hit, full = await _generate(cached.url, turn), await _generate(plain.url, turn)
        # The last turn fed its prompt and all of its answer but the last token.
        assert hit["meta_info"]["cached_tokens"] == len(before) + len(answer) - 1
        assert full["meta_info"]["cached_tokens"] == 0
        assert hit["output_ids"] == full["output_ids"]
        torch.testing.assert_close(
            torch.tensor([t[0] for t in hit["meta_info"]["output_token_logprobs"]]),
            torch.tensor([t[0] for t in full["meta_info"]["output_token_logprobs"]]),
            atol=1e-5,
            rtol=1e-5,
        )
        before, answer = turn, hit["output_ids"]
    state = await _info(cached.url)
    assert state["num_prefix_cache_hits"] >= 3 and state["prefix_cache_entries"] >= 1
    assert "prefix_cache_entries" not in await _info(plain.url)


async def test_new_weights_and_flush_cache_empty_the_cache(engines, tiny_model_dir):
    cached, _ = engines
    prompt = [ord(c) for c in "Another conversation, long enough to be kept: "]
    await _generate(cached.url, prompt)
    assert (await _generate(cached.url, prompt + [33]))["meta_info"]["cached_tokens"] > 0
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            cached.url + "/update_weights_from_disk",
            json={"model_path": str(tiny_model_dir), "weight_version": "1"},
        )
        assert response.status_code == 200 and response.json()["success"], response.text
    assert (await _info(cached.url))["prefix_cache_entries"] == 0
    assert (await _generate(cached.url, prompt + [33]))["meta_info"]["cached_tokens"] == 0
    assert (await _info(cached.url))["prefix_cache_entries"] == 1
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.post(cached.url + "/flush_cache")).status_code == 200
    assert (await _info(cached.url))["prefix_cache_entries"] == 0
