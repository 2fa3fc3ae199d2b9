"""What a streamed choice may send as each token arrives (``streaming.ChoiceText``), token by
token with the tiny model's byte-level tokenizer: no half character, no stop string, no
tool-call markup, no stop token, and logprob entries that follow the text sent."""

from __future__ import annotations

from rl_core.inference.client import GenerateChunk
from webapp.gateway.chat_request import ChatRequest
from webapp.gateway.streaming import ChoiceText

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def _stream(tok, text: str, *, stop_token: bool = True, **request) -> tuple[ChoiceText, list]:
    request.setdefault("logprobs", True)  # these tests follow each token's entry
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}], **request)
    choice = ChoiceText(tok, chat)
    ids = tok.encode(text)
    if stop_token:
        ids.append(tok.eos_token_ids[0])
    sent = []
    for position, token in enumerate(ids):
        last = position == len(ids) - 1
        chunk = GenerateChunk(output_ids=[token], output_logprobs=[-float(position)], versions=[0])
        if last:
            chunk.finish_reason = "stop" if stop_token else "length"
            chunk.matched_stop = token if stop_token else None
        choice.add(chunk)
        sent.append(choice.step(last))
    return choice, sent


def test_a_character_split_over_tokens_goes_out_whole_with_its_tokens_entries(chat_tokenizer):
    choice, sent = _stream(chat_tokenizer, "héllo wörld")
    pieces = [piece for piece, _ in sent]
    assert "".join(pieces) == "héllo wörld"
    assert not any("\ufffd" in piece for piece in pieces)
    assert len(choice.ids) > len("héllo wörld") + 1  # the accents took two tokens each
    # Each entry goes with the piece that completes its token's text: é's two with "é".
    assert [len(batch) for piece, batch in sent][:3] == [1, 0, 2]
    entries = [entry["logprob"] for _, batch in sent for entry in batch]
    assert entries == choice.logprobs[:-1]


def test_the_stop_token_has_neither_text_nor_a_logprob_entry(chat_tokenizer):
    choice, sent = _stream(chat_tokenizer, "hello")
    entries = [entry for _, batch in sent for entry in batch]
    assert [entry["logprob"] for entry in entries] == choice.logprobs[:-1]
    assert "".join(entry["token"] for entry in entries) == "hello"


def test_text_that_may_begin_a_stop_string_waits_and_the_stop_string_never_goes(chat_tokenizer):
    _, sent = _stream(chat_tokenizer, "hello world", stop_token=False, stop=["lo w"])
    pieces = [piece for piece, _ in sent]
    assert "".join(pieces) == "hel"
    assert pieces[:4] == ["h", "e", "", "l"]  # "hel": that "l" may begin "lo w"; "hell": not


def test_tool_call_markup_is_held_and_parsed_at_the_end(chat_tokenizer):
    markup = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    choice, sent = _stream(chat_tokenizer, "Let me check." + markup, tools=TOOLS)
    assert "".join(piece for piece, _ in sent) == "Let me check."
    entries = [entry for _, batch in sent for entry in batch]
    assert "".join(entry["token"] for entry in entries) == "Let me check."
    calls, extra = choice.tool_calls()
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and extra == ""


def test_a_lone_angle_bracket_is_text_once_the_markup_is_ruled_out(chat_tokenizer):
    _, sent = _stream(chat_tokenizer, "a <b> c", tools=TOOLS)
    pieces = [piece for piece, _ in sent]
    assert "".join(pieces) == "a <b> c"
    assert pieces[2] == ""  # "a <" could begin "<tool_call>"


def test_without_logprobs_tokens_that_arrive_together_are_decoded_together(chat_tokenizer):
    text = "héllo wörld, ünïcode"
    ids = chat_tokenizer.encode(text)
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}])
    choice = ChoiceText(chat_tokenizer, chat)
    pieces = []
    for at in range(0, len(ids), 3):  # three tokens per event, as a gateway behind would read
        chunk = GenerateChunk(output_ids=ids[at : at + 3], output_logprobs=[], versions=[0] * 3)
        last = at + 3 >= len(ids)
        if last:
            chunk.finish_reason = "length"
        choice.add(chunk)
        piece, entries = choice.step(last)
        assert entries is None  # nobody asked for them: none are built
        pieces.append(piece)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert choice.output()["text"] == text


def test_the_matched_stop_is_the_engines_word_else_the_first_in_the_text():
    from webapp.gateway.replies import matched_stop

    stops = ["abc", "ab", "zz"]
    assert matched_stop("xx ab and zz", stops, "zz") == "zz"  # the engine named it
    assert matched_stop("xx abc, zz", stops, 50256) == "ab"  # a token id: found in the text,
    assert matched_stop("xx abc, zz", stops) == "ab"  # where the shorter one ended it first
    assert matched_stop("xx zz ab", stops, "not asked") == "zz"
    assert matched_stop("nothing", stops) is None
