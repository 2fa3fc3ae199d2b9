"""Chat completions through the official SDK: OpenAI's shapes, and every token recorded as served."""

from __future__ import annotations

import json

import pytest

from webapp.gateway.models import Interaction, Session

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]


def test_a_completion_has_openai_shape_and_is_recorded_token_exact(gw, chat_tokenizer):
    completion = gw.openai().chat.completions.create(
        model=gw.model, messages=HI, max_tokens=8, seed=1
    )

    interaction = Interaction.objects.select_related("session").get(pk=completion.id)
    out = interaction.outputs[0]
    choice = completion.choices[0]
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == gw.model
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == out["text"] == chat_tokenizer.decode(out["output_ids"])
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert interaction.input_ids == chat_tokenizer.encode(chat_tokenizer.render(HI))
    assert completion.usage.prompt_tokens == len(interaction.input_ids)
    assert completion.usage.completion_tokens == len(out["output_ids"]) <= 8
    assert completion.usage.total_tokens == len(interaction.input_ids) + len(out["output_ids"])
    assert len(out["logprobs"]) == len(out["output_ids"])
    assert out["versions"] == [0] * len(out["output_ids"])
    assert interaction.server_url == gw.run.servers.get().url
    session = interaction.session
    assert session.one_turn and session.status == "open" and session.trajectory == "pending"
    assert session.agent_id == gw.agent.id and session.run_id == gw.run.id


def test_models_lists_the_runs_policy(gw):
    models = gw.openai().models.list()
    assert [m.id for m in models.data] == [gw.model]
    assert models.data[0].owned_by == "steep"


def test_a_stream_is_sse_chunks_ending_with_usage_and_done(gw):
    client = gw.openai()
    chunks = list(
        client.chat.completions.create(
            model=gw.model,
            messages=HI,
            max_tokens=12,
            seed=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    interaction = Interaction.objects.get(pk=chunks[0].id)
    out = interaction.outputs[0]
    assert {c.id for c in chunks} == {interaction.id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == out["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == len(out["output_ids"])
    assert usage_chunk.usage.prompt_tokens == len(interaction.input_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_the_raw_stream_is_event_stream_data_lines_ending_with_done(gw):
    body = {"model": gw.model, "messages": HI, "max_tokens": 4, "stream": True}
    with gw.http.stream(
        "POST",
        gw.base_url + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {gw.key}"},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in events[:-1]]
    assert all("usage" not in p for p in payloads)  # only with stream_options.include_usage
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_n_2_returns_two_choices_and_records_both(gw):
    completion = gw.openai().chat.completions.create(
        model=gw.model, messages=HI, n=2, max_tokens=8, seed=3
    )

    interaction = Interaction.objects.get(pk=completion.id)
    assert [c.index for c in completion.choices] == [0, 1]
    assert len(interaction.outputs) == 2
    for choice, out in zip(completion.choices, interaction.outputs, strict=True):
        assert choice.message.content == out["text"]
        assert len(out["logprobs"]) == len(out["versions"]) == len(out["output_ids"]) > 0
    assert interaction.outputs[0]["output_ids"] != interaction.outputs[1]["output_ids"]
    assert completion.usage.completion_tokens == sum(
        len(out["output_ids"]) for out in interaction.outputs
    )
    assert interaction.sampling["n"] == 2


def test_stop_ends_the_answer_before_the_stop_string(gw):
    client = gw.openai()
    free = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=30, temperature=0)
    text = free.choices[0].message.content
    # An ASCII character the greedy answer reaches after at least one other character.
    stop = next(ch for ch in text[1:] if ch.isascii() and ch.isprintable() and ch not in text[:1])
    expected = text[: text.index(stop)]

    stopped = client.chat.completions.create(
        model=gw.model, messages=HI, max_tokens=30, temperature=0, stop=[stop]
    )

    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"
    out = Interaction.objects.get(pk=stopped.id).outputs[0]
    assert out["text"] == expected
    assert (
        out["output_ids"]
        == Interaction.objects.get(pk=free.id).outputs[0]["output_ids"][: len(out["output_ids"])]
    )


def test_max_tokens_and_max_completion_tokens_cap_the_answer(gw):
    client = gw.openai()
    capped = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=5, seed=4)
    assert capped.usage.completion_tokens == 5
    assert capped.choices[0].finish_reason == "length"

    # max_completion_tokens (the newer name) wins over max_tokens.
    both = client.chat.completions.create(
        model=gw.model, messages=HI, max_tokens=7, max_completion_tokens=3, seed=4
    )
    assert both.usage.completion_tokens == 3
    assert len(Interaction.objects.get(pk=both.id).outputs[0]["output_ids"]) == 3
    assert Interaction.objects.get(pk=both.id).sampling["max_new_tokens"] == 3


def test_logprobs_and_top_logprobs_have_openai_shape_and_equal_the_recorded_ones(
    gw, chat_tokenizer
):
    completion = gw.openai().chat.completions.create(
        model=gw.model, messages=HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )

    out = Interaction.objects.get(pk=completion.id).outputs[0]
    content = completion.choices[0].logprobs.content
    assert len(content) == len(out["output_ids"]) == 6
    assert [item.logprob for item in content] == out["logprobs"]
    for item, token_id in zip(content, out["output_ids"], strict=True):
        assert item.token == chat_tokenizer.token_text(token_id)
        assert item.bytes == list(item.token.encode())
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 3
        tops = [top.logprob for top in item.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)


def test_logprobs_stream_one_token_per_chunk(gw):
    chunks = list(
        gw.openai().chat.completions.create(
            model=gw.model, messages=HI, max_tokens=4, seed=5, logprobs=True, stream=True
        )
    )
    out = Interaction.objects.get(pk=chunks[0].id).outputs[0]
    streamed = [
        item.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content
    ]
    assert streamed == out["logprobs"]


def test_a_one_turn_completion_opens_nothing_but_its_own_session(gw):
    gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    assert Session.objects.count() == 1 and Interaction.objects.count() == 1
