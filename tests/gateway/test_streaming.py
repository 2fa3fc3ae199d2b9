"""``stream: true`` sends tokens as the engine produces them: the first chunk arrives while
the engine still runs the request, the recorded turn is what was streamed, and a client that
goes away mid-stream leaves an aborted turn that is kept and never trained."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from webapp.gateway.models import Interaction, Session
from webapp.gateway.selectors import session_trajectories

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Tell me a long story."}]


def _engine_state(engine) -> dict:
    return httpx.get(engine.url + "/server_info", timeout=30).json()["internal_states"][0]


@contextlib.contextmanager
def _slow(engine, seconds: float = 0.05):
    """Every decode step of the shared engine sleeps ``seconds`` meanwhile (SGLang's knob)."""
    httpx.post(engine.url + "/slow_down", json={"forward_sleep_time": seconds}, timeout=30)
    try:
        yield
    finally:
        httpx.post(engine.url + "/slow_down", json={"forward_sleep_time": None}, timeout=30)


# A stream a client leaves after its first event: greedy, since a sampled stop token could
# end it before the client goes.
LONG_STREAM = {"max_tokens": 400, "temperature": 0, "stream": True}


def _wait_for(condition, what: str, timeout: float = 60.0):
    # A bound on how long to wait for an event, not a measure of speed.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _leave_after_first_event(http, gw, body: dict, key: str) -> str:
    """Stream ``body`` with ``key``, go away after the first event; the interaction id."""
    with http.stream(
        "POST",
        gw.base_url + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        return json.loads(next(line for line in lines if line)[6:])["id"]


def test_the_first_chunk_arrives_while_the_engine_is_still_generating(gw, engine):
    with _slow(engine):
        stream = gw.openai().chat.completions.create(
            model=gw.model, messages=HI, max_tokens=24, seed=3, stream=True
        )
        running_at = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                running_at.append(_engine_state(engine)["num_running_reqs"])
        stream.close()
    # The first content delta came while the request was still running on the engine; the
    # old replay sent every chunk after the generation had ended (and been recorded).
    assert running_at and running_at[0] == 1
    assert _engine_state(engine)["num_running_reqs"] == 0


def test_the_recorded_turn_equals_the_streamed_text_and_ids(gw, chat_tokenizer):
    body = {"model": gw.model, "messages": HI, "max_tokens": 20, "seed": 11}
    chunks = list(
        gw.openai().chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    recorded = Interaction.objects.get(pk=chunks[0].id)
    assert {c.id for c in chunks} == {recorded.id}
    assert recorded.response["choices"][0]["message"]["content"] == streamed
    out = recorded.outputs[0]
    assert chat_tokenizer.decode(out["output_ids"]) == streamed
    assert chunks[-1].usage.completion_tokens == len(out["output_ids"])
    assert not recorded.aborted
    # The same request unstreamed samples the same tokens (same seed) and says the same.
    plain = gw.openai().chat.completions.create(**body)
    assert Interaction.objects.get(pk=plain.id).outputs[0]["output_ids"] == out["output_ids"]
    assert plain.choices[0].message.content == streamed


def test_a_stop_string_is_never_streamed(gw):
    body = {"model": gw.model, "messages": HI, "max_tokens": 16, "temperature": 0}
    full = gw.openai().chat.completions.create(**body).choices[0].message.content
    stop = full[6:9]
    assert len(stop) == 3 and full.find(stop) == 6
    chunks = list(gw.openai().chat.completions.create(**body, stop=[stop], stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == full[:6]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_streamed_logprobs_are_aligned_with_the_streamed_text(gw, chat_tokenizer):
    chunks = list(
        gw.openai().chat.completions.create(
            model=gw.model, messages=HI, max_tokens=12, seed=5, logprobs=True, stream=True
        )
    )
    recorded = Interaction.objects.get(pk=chunks[0].id).outputs[0]
    entries = [
        item
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(item.token for item in entries) == chat_tokenizer.decode(
        recorded["output_ids"][: len(entries)], skip_special_tokens=False
    )
    assert [item.logprob for item in entries] == recorded["logprobs"][: len(entries)]
    assert text == chat_tokenizer.decode(recorded["output_ids"])


def test_a_client_that_goes_away_mid_stream_aborts_the_engine_request_and_the_turn_is_not_trained(
    gw, engine, http
):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    first = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4, seed=1)
    messages = [*HI, first.choices[0].message.model_dump(exclude_none=True)]
    messages.append({"role": "user", "content": "Go on."})
    aborted_before = _engine_state(engine)["num_aborted_reqs"]
    body = {"model": gw.model, "messages": messages, **LONG_STREAM}
    with _slow(engine):
        # Gone after the first event, while the engine still generates (400 slow tokens).
        interaction_id = _leave_after_first_event(http, gw, body, key)
        turn = _wait_for(
            lambda: Interaction.objects.filter(pk=interaction_id).first(), "the aborted turn"
        )
        assert _engine_state(engine)["num_aborted_reqs"] == aborted_before + 1
    assert turn.aborted and turn.outputs[0]["finish_reason"] == "abort"
    assert len(turn.outputs[0]["output_ids"]) < 400
    assert turn.request_hash == ""  # never replayed to a retry
    # Kept (listed with its session), but no token of it is trained.
    session = Session.objects.get(pk=session_id)
    assert session.interactions.count() == 2
    trajectories = session_trajectories(session)
    assert [t.metadata["interactions"] for t in trajectories] == [[first.id]]
    detail = http.get(
        f"{gw.server}/api/v1/sessions/{session_id}/",
        headers={"Authorization": f"Bearer {gw.key}"},
    ).json()
    assert [t["aborted"] for t in detail["interactions"]] == [False, True]


def test_a_retry_after_an_aborted_turn_continues_the_same_trajectory(gw, engine, http):
    """The retry of a turn whose stream was cut continues turn 1 (its tokens reused, as for
    any next turn), and the episode stays one trajectory: turn 1 and the retry, no gap."""
    session_id, key = gw.start_session()
    client = gw.openai(key)
    first = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4, seed=1)
    messages = [*HI, first.choices[0].message.model_dump(exclude_none=True)]
    messages.append({"role": "user", "content": "Go on."})
    body = {"model": gw.model, "messages": messages, **LONG_STREAM}
    with _slow(engine):
        aborted_id = _leave_after_first_event(http, gw, body, key)
        _wait_for(lambda: Interaction.objects.filter(pk=aborted_id).first(), "the aborted turn")
    retry = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=4)
    third = client.chat.completions.create(
        model=gw.model,
        messages=[
            *messages,
            retry.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "And then?"},
        ],
        max_tokens=4,
    )
    assert gw.post("/rl/set_reward", {"reward": 1.0}, key=key).status_code == 200
    session = Session.objects.get(pk=session_id)
    turns = {t.id: t for t in session.interactions.all()}
    assert turns[aborted_id].aborted and not turns[retry.id].aborted
    # The retry's prompt begins with turn 1's tokens, as an unbroken next turn's does.
    one = turns[first.id]
    assert turns[retry.id].prefix_reused
    assert turns[retry.id].input_ids[: len(one.input_ids)] == one.input_ids
    trajectories = session_trajectories(session)
    assert [t.metadata["interactions"] for t in trajectories] == [[first.id, retry.id, third.id]]


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("presence_penalty", 1.5),
        ("frequency_penalty", 0.7),
        ("repetition_penalty", 1.3),
        ("min_p", 0.05),
    ],
)
def test_a_supported_sampling_parameter_is_used_and_recorded(gw, param, value):
    completion = gw.openai().chat.completions.create(
        model=gw.model, messages=HI, max_tokens=6, seed=2, extra_body={param: value}
    )
    assert Interaction.objects.get(pk=completion.id).sampling[param] == value


def test_min_tokens_keeps_an_answer_going_past_its_end_of_turn(gw, openai_error):
    kept = gw.openai().chat.completions.create(
        model=gw.model, messages=HI, max_tokens=40, temperature=0, extra_body={"min_tokens": 40}
    )
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 40
    assert Interaction.objects.get(pk=kept.id).sampling["min_new_tokens"] == 40
    too_many = gw.post(
        "/chat/completions",
        {"model": gw.model, "messages": HI, "max_tokens": 4, "min_tokens": 5},
    )
    assert openai_error(too_many, 400)["param"] == "min_tokens"


def test_a_penalty_changes_what_greedy_decoding_repeats(gw):
    body = {"model": gw.model, "messages": HI, "max_tokens": 24, "temperature": 0}
    plain = gw.openai().chat.completions.create(**body)
    penalised = gw.openai().chat.completions.create(**body, frequency_penalty=2.0)
    ids = [Interaction.objects.get(pk=c.id).outputs[0]["output_ids"] for c in (plain, penalised)]
    assert len(set(ids[1])) > len(set(ids[0]))  # the penalty pushes away from repeated tokens


def test_n_streamed_choices_each_record_what_was_streamed_for_them(gw, chat_tokenizer):
    chunks = list(
        gw.openai().chat.completions.create(
            model=gw.model, messages=HI, max_tokens=10, seed=4, n=2, stream=True
        )
    )
    streamed = ["", ""]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    recorded = Interaction.objects.get(pk=chunks[0].id)
    messages = [choice["message"]["content"] for choice in recorded.response["choices"]]
    assert messages == streamed
    assert [chat_tokenizer.decode(out["output_ids"]) for out in recorded.outputs] == streamed
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1]


def test_a_client_gone_mid_stream_of_n_choices_aborts_each_of_them(gw, engine, http):
    aborted_before = _engine_state(engine)["num_aborted_reqs"]
    body = {"model": gw.model, "messages": HI, "n": 2, **LONG_STREAM}
    with _slow(engine):
        interaction_id = _leave_after_first_event(http, gw, body, gw.key)
        turn = _wait_for(
            lambda: Interaction.objects.filter(pk=interaction_id).first(), "the aborted turn"
        )
        _wait_for(
            lambda: _engine_state(engine)["num_aborted_reqs"] == aborted_before + 2,
            "both engine requests aborted",
        )
    assert [out.get("aborted") for out in turn.outputs] == [True, True]
    assert session_trajectories(turn.session) == []


def test_a_stream_fails_over_from_a_dead_server_before_its_first_token(
    make_gateway, project, api_key, engine
):
    from tests.gateway.test_inference_servers import _dead_url

    gw = make_gateway(project, api_key, servers=[_dead_url(), engine.url])
    chunks = list(
        gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=3, stream=True)
    )
    assert Interaction.objects.get(pk=chunks[0].id).server_url == engine.url


def test_a_stream_with_every_server_dead_is_a_503_before_any_event(
    make_gateway, project, api_key, openai_error
):
    from tests.gateway.test_inference_servers import _dead_url

    gw = make_gateway(project, api_key, servers=[_dead_url()])
    response = gw.post("/chat/completions", {"messages": HI, "stream": True})
    assert openai_error(response, 503)["code"] == "inference_unavailable"
    assert not Session.objects.exists() and not Interaction.objects.exists()


def test_djangos_route_also_aborts_a_stream_whose_client_went_away(gw, engine):
    """The same stream through Django's view (the route used where the fast route is not, e.g.
    under another ASGI server): its ASGI handler cancels the response when the client goes
    away, and the turn is recorded aborted as on the fast route."""
    import asyncio

    from django.core.asgi import get_asgi_application

    session_id, key = gw.start_session()
    body = {"model": gw.model, "messages": HI, **LONG_STREAM}
    sent: list[dict] = []

    async def call() -> None:
        first_event = asyncio.Event()
        requested = False

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": json.dumps(body).encode()}
            await first_event.wait()  # gone once the first event arrived
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                first_event.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": f"/agents/{gw.agent.id}/v1/chat/completions",
            "raw_path": f"/agents/{gw.agent.id}/v1/chat/completions".encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"host", b"testserver"),
                (b"authorization", f"Bearer {key}".encode()),
                (b"content-type", b"application/json"),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        await asyncio.wait_for(get_asgi_application()(scope, receive, send), 120)

    aborted_before = _engine_state(engine)["num_aborted_reqs"]
    with _slow(engine):
        asyncio.run(call())
        turn = _wait_for(
            lambda: Interaction.objects.filter(session_id=session_id).first(), "the aborted turn"
        )
        assert _engine_state(engine)["num_aborted_reqs"] == aborted_before + 1
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    first = json.loads(sent[1]["body"].split(b"\n")[0][6:])
    assert first["id"] == turn.id
    assert turn.aborted and turn.outputs[0]["finish_reason"] == "abort"
    assert len(turn.outputs[0]["output_ids"]) < 400
    assert session_trajectories(Session.objects.get(pk=session_id)) == []


def test_a_one_turn_stream_whose_client_left_ends_dropped_and_gives_its_slot_back(gw, engine, http):
    from webapp.runs.models import Run

    body = {"model": gw.model, "messages": HI, **LONG_STREAM}
    with _slow(engine):
        # The project key: a one-turn session
        interaction_id = _leave_after_first_event(http, gw, body, gw.key)
        turn = _wait_for(
            lambda: Interaction.objects.filter(pk=interaction_id).first(), "the aborted turn"
        )
    session = turn.session
    assert turn.aborted and session.one_turn
    # Nothing of it can train, so it does not wait to expire holding an admission slot.
    assert (session.status, session.trajectory, session.drop_reason) == (
        Session.Status.ENDED,
        Session.Trajectory.DROPPED,
        "aborted",
    )
    run = Run.objects.get(pk=session.run_id)
    assert (run.sessions_open, run.sessions_accepted) == (0, 0)
