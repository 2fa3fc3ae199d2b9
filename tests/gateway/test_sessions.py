"""The RL protocol: sessions over several turns, rewards, ends, expiry, and the trajectory they make."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from openai import APIStatusError, ConflictError

from webapp.accounts.keys import SESSION_KEY_PREFIX, hash_key
from webapp.gateway.chat_request import PreviousTurn
from webapp.gateway.models import Interaction, Session
from webapp.gateway.prompts import build_prompt
from webapp.gateway.selectors import session_trajectories
from webapp.gateway.tasks import sessions_expire_idle

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]


def _converse(client, model: str, turns: int, *, max_tokens: int = 10) -> tuple[list, list[str]]:
    """Several turns the way an agent makes them: append the answer and a new user message."""
    messages: list = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = []
    for turn in range(turns):
        completion = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, seed=turn
        )
        ids.append(completion.id)
        messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": f"And then {turn}?"},
        ]
    return messages, ids


def _generated(interaction: Interaction) -> list[int]:
    return interaction.outputs[interaction.chosen]["output_ids"]


def test_a_multi_turn_session_becomes_one_token_exact_trajectory_with_per_turn_rewards(gw):
    session_id, key = gw.start_session(task_id="task-7", metadata={"split": "train"})
    assert key.startswith(SESSION_KEY_PREFIX)
    _, ids = _converse(gw.openai(key), gw.model, 3)

    turns = list(Interaction.objects.filter(session_id=session_id).order_by("turn"))
    assert [t.id for t in turns] == ids
    assert [t.prefix_reused for t in turns] == [False, True, True]
    final = turns[-1]
    stream = final.input_ids + _generated(final)
    for turn in turns:  # the last turn's tokens extend every earlier turn's exactly
        earlier = turn.input_ids + _generated(turn)
        assert stream[: len(earlier)] == earlier
    assert all(v == 0 for t in turns for v in t.outputs[0]["versions"])

    # Per-turn rewards by id, the last one without.
    for interaction_id, reward in zip(ids[:2], [0.25, 0.5], strict=True):
        response = gw.post(
            "/rl/set_reward", {"reward": reward, "interaction_id": interaction_id}, key=key
        )
        assert response.status_code == 200, response.text
        assert response.json() == {
            "interaction_id": interaction_id,
            "session_id": session_id,
            "reward": reward,
        }
    last = gw.post("/rl/set_reward", {"reward": 1}, key=key)
    assert last.status_code == 200 and last.json()["interaction_id"] == ids[2]

    ended = gw.post("/rl/end_session", key=key)
    assert ended.status_code == 200, ended.text
    assert ended.json()["session_id"] == session_id
    assert ended.json()["interaction_count"] == 3

    session = Session.objects.get(pk=session_id)
    assert (session.status, session.trajectory) == ("ended", "ready")
    assert session.task_id == "task-7" and session.metadata == {"split": "train"}
    [trajectory] = session_trajectories(session)
    assert trajectory.input_ids == stream
    assert trajectory.session_id == session_id
    assert trajectory.rewards == [0.25, 0.5, 1.0]
    spans = [(len(t.input_ids), len(t.input_ids) + len(_generated(t))) for t in turns]
    masked = [i for i, m in enumerate(trajectory.loss_mask) if m]
    assert masked == [i for start, end in spans for i in range(start, end)]
    assert trajectory.turn_ends[:-1] == [end for _, end in spans[:-1]]
    recorded = [lp for t in turns for lp in t.outputs[t.chosen]["logprobs"]]
    assert [trajectory.logprobs[i] for i in masked] == recorded
    assert [trajectory.versions[i] for i in masked] == [0] * len(masked)
    assert all(
        v == -1 for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True) if not m
    )


def test_tokens_generated_after_a_weight_update_carry_the_new_version(
    gw, engine, load_weights, tiny_model_dir, perturbed_model_dir
):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    messages = [*HI]
    first = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=6)
    assert first.system_fingerprint == "steep-v0"
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]

    load_weights(engine, perturbed_model_dir, 1)  # what the trainer does after a step
    try:
        second = client.chat.completions.create(model=gw.model, messages=messages, max_tokens=6)
    finally:
        load_weights(engine, tiny_model_dir, 0)

    assert second.system_fingerprint == "steep-v1"
    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")
    assert set(turn0.outputs[0]["versions"]) == {0}
    assert turn1.outputs[0]["versions"] == [1] * len(turn1.outputs[0]["output_ids"])
    assert turn1.prefix_reused
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    gw.post("/rl/end_session", key=key)
    [trajectory] = session_trajectories(Session.objects.get(pk=session_id))
    generated = [v for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True) if m]
    assert generated == [0] * len(turn0.outputs[0]["output_ids"]) + [1] * len(
        turn1.outputs[0]["output_ids"]
    )


def test_an_idle_session_expires_and_then_answers_410_everywhere(
    gw, settings, server_env, openai_error
):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    first = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4)
    # Expiry runs here, as the celery beat task would, with the server's short timeout.
    timeout = int(server_env["SESSION_IDLE_TIMEOUT_S"])
    settings.SESSION_IDLE_TIMEOUT_S = timeout
    assert sessions_expire_idle() == 0  # active just now
    Session.objects.filter(pk=session_id).update(
        last_activity_at=timezone.now() - timedelta(seconds=timeout + 1)
    )

    assert sessions_expire_idle() == 1

    session = Session.objects.get(pk=session_id)
    assert (session.status, session.trajectory) == ("expired", "unrewarded")
    assert session.ended_at is not None
    with pytest.raises(APIStatusError) as exc:
        client.chat.completions.create(
            model=gw.model,
            messages=[*HI, first.choices[0].message, {"role": "user", "content": "Hello?"}],
            max_tokens=4,
        )
    error = openai_error(exc.value, 410)
    assert error["code"] == "session_expired" and f"{timeout} s idle" in error["message"]
    assert "start_session" in error["message"]
    reward = gw.post("/rl/set_reward", {"reward": 1.0, "interaction_id": first.id}, key=key)
    assert openai_error(reward, 410)["code"] == "session_expired"
    assert openai_error(gw.post("/rl/end_session", key=key), 410)["code"] == "session_expired"
    assert openai_error(gw.post("/rl/start_session", key=key), 410)["code"] == "session_expired"
    assert Interaction.objects.count() == 1 and Session.objects.count() == 1
    assert Interaction.objects.get().reward is None


def test_an_expired_rewarded_session_trains_only_when_the_run_says_so(
    make_gateway, project, api_key, settings
):
    settings.SESSION_IDLE_TIMEOUT_S = 2
    outcomes = {}
    for train_incomplete in (False, True):
        gw = make_gateway(
            project,
            api_key,
            name=f"incomplete-{train_incomplete}",
            train_incomplete_sessions=train_incomplete,
        )
        session_id, key = gw.start_session()
        gw.openai(key).chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
        assert gw.post("/rl/set_reward", {"reward": 1.0}, key=key).status_code == 200
        Session.objects.filter(pk=session_id).update(
            last_activity_at=timezone.now() - timedelta(seconds=3)
        )
        sessions_expire_idle()
        outcomes[train_incomplete] = Session.objects.get(pk=session_id).trajectory
    assert outcomes == {False: "unrewarded", True: "ready"}


def test_an_ended_session_refuses_new_rewards_and_turns_with_409(gw, openai_error):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    completion = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=4)
    assert gw.post("/rl/set_reward", {"reward": 1.0}, key=key).status_code == 200
    assert gw.post("/rl/end_session", key=key).status_code == 200

    changed = gw.post("/rl/set_reward", {"reward": 0.0, "interaction_id": completion.id}, key=key)
    assert openai_error(changed, 409)["code"] == "session_ended"
    # Re-sending the reward it already has (an SDK retry) is harmless.
    assert gw.post("/rl/set_reward", {"reward": 1.0}, key=key).status_code == 200
    assert openai_error(gw.post("/rl/end_session", key=key), 409)["code"] == "session_ended"
    with pytest.raises(ConflictError) as exc:
        client.chat.completions.create(
            model=gw.model, messages=[{"role": "user", "content": "again"}], max_tokens=4
        )
    assert openai_error(exc.value, 409)["code"] == "session_ended"
    assert openai_error(gw.post("/rl/start_session", key=key), 409)["code"] == "session_ended"
    assert Interaction.objects.get().reward == 1.0
    assert Session.objects.get().trajectory == "ready"


def test_rewards_for_another_agents_or_projects_session_are_refused(
    make_gateway, project, api_key, other_project, other_api_key, openai_error
):
    a = make_gateway(project, api_key, name="a")
    b = make_gateway(project, api_key, name="b", run=a.run)
    rival = make_gateway(other_project, other_api_key, name="rival")
    _, key_a = a.start_session()
    interaction = a.openai(key_a).chat.completions.create(model=a.model, messages=HI, max_tokens=2)
    body = {"reward": 1.0, "interaction_id": interaction.id}

    # A's session key on agent B, or the project key on B naming A's turn: not found.
    assert openai_error(b.post("/rl/set_reward", body, key=key_a), 404)["code"] == "agent_not_found"
    assert openai_error(b.post("/rl/set_reward", body), 404)["code"] == "interaction_not_found"
    # Another project: its key on A, or its own agent naming A's turn.
    assert openai_error(a.post("/rl/set_reward", body, key=other_api_key), 404)["code"] == (
        "agent_not_found"
    )
    assert openai_error(rival.post("/rl/set_reward", body), 404)["code"] == "interaction_not_found"
    # A key that was never issued.
    assert openai_error(a.post("/rl/set_reward", body, key=SESSION_KEY_PREFIX + "x"), 401)
    # Another session of A naming this one's turn.
    _, other_key_a = a.start_session()
    assert openai_error(a.post("/rl/set_reward", body, key=other_key_a), 404)["code"] == (
        "interaction_not_found"
    )
    assert Interaction.objects.get().reward is None


def test_start_session_with_a_live_session_key_ends_it_and_rebinds_the_key(gw):
    old_id, key = gw.start_session(task_id="first")
    client = gw.openai(key)
    client.chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    gw.post("/rl/set_reward", {"reward": 0.5}, key=key)

    response = gw.post("/rl/start_session", {"task_id": "second"}, key=key)

    assert response.status_code == 201, response.text
    new_id = response.json()["session_id"]
    assert response.json()["api_key"] == key and new_id != old_id
    old, new = Session.objects.get(pk=old_id), Session.objects.get(pk=new_id)
    assert (old.status, old.trajectory, old.key_hash) == ("ended", "ready", None)
    assert (new.status, new.key_hash, new.task_id) == ("open", hash_key(key), "second")
    completion = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=2)
    recorded = Interaction.objects.get(pk=completion.id)
    assert recorded.session_id == new.id and recorded.turn == 0
    assert old.interactions.count() == 1


def test_a_one_turn_completion_rewarded_by_its_id_ends_ready_and_a_repeat_reward_is_stored_once(
    gw, openai_error
):
    completion = gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=4)
    session = Interaction.objects.get(pk=completion.id).session
    assert session.one_turn and session.key_hash is None
    assert (session.status, session.trajectory) == ("open", "pending")

    body = {"reward": 1, "interaction_id": completion.id}
    first = gw.post("/rl/set_reward", body)
    assert first.status_code == 200, first.text
    assert first.json() == {
        "interaction_id": completion.id,
        "session_id": str(session.id),
        "reward": 1.0,
    }
    interaction = Interaction.objects.get(pk=completion.id)
    rewarded_at = interaction.rewarded_at
    session.refresh_from_db()
    assert (session.status, session.trajectory) == ("ended", "ready")

    again = gw.post("/rl/set_reward", body)
    assert again.status_code == 200 and again.json() == first.json()
    interaction.refresh_from_db()
    assert interaction.reward == 1.0 and interaction.rewarded_at == rewarded_at
    [trajectory] = session_trajectories(session)
    assert trajectory.rewards == [1.0]
    assert Session.objects.count() == 1 and Interaction.objects.count() == 1

    missing_id = gw.post("/rl/set_reward", {"reward": 1.0})
    assert openai_error(missing_id, 400)["param"] == "interaction_id"
    assert openai_error(gw.post("/rl/end_session"), 400)["code"] == "session_key_required"


def test_continuing_with_the_second_of_two_choices_trains_that_choice(gw):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    prompt = [{"role": "user", "content": "Tell me a story."}]
    first = client.chat.completions.create(
        model=gw.model, messages=prompt, n=2, max_tokens=8, seed=1
    )
    picked = first.choices[1].message
    assert picked.content != first.choices[0].message.content
    messages = [*prompt, picked, {"role": "user", "content": "Thanks."}]
    client.chat.completions.create(model=gw.model, messages=messages, max_tokens=4)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    gw.post("/rl/end_session", key=key)

    turn0, turn1 = Interaction.objects.filter(session_id=session_id).order_by("turn")
    assert turn0.chosen == 1 and turn1.prefix_reused
    chosen_ids = turn0.outputs[1]["output_ids"]
    assert turn1.input_ids[: len(turn0.input_ids) + len(chosen_ids)] == turn0.input_ids + chosen_ids
    [trajectory] = session_trajectories(Session.objects.get(pk=session_id))
    start = len(turn0.input_ids)
    assert trajectory.loss_mask[start : start + len(chosen_ids)] == [1] * len(chosen_ids)
    assert trajectory.logprobs[start : start + len(chosen_ids)] == turn0.outputs[1]["logprobs"]


def test_a_conversation_that_rewrites_history_starts_a_new_sequence(gw):
    session_id, key = gw.start_session()
    client = gw.openai(key)
    first = client.chat.completions.create(model=gw.model, messages=HI, max_tokens=6, seed=8)
    edited = [
        *HI,
        {"role": "assistant", "content": "Hello! (edited by the agent)"},
        {"role": "user", "content": "Go on."},
    ]
    second = client.chat.completions.create(model=gw.model, messages=edited, max_tokens=4)
    gw.post("/rl/set_reward", {"reward": 0.5, "interaction_id": first.id}, key=key)
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    gw.post("/rl/end_session", key=key)

    turn1 = Interaction.objects.get(pk=second.id)
    assert not turn1.prefix_reused
    trajectories = session_trajectories(Session.objects.get(pk=session_id))
    assert [t.session_id for t in trajectories] == [f"{session_id}#0", f"{session_id}#1"]
    assert [t.rewards for t in trajectories] == [[0.5], [1.0]]
    assert trajectories[1].input_ids == turn1.input_ids + turn1.outputs[0]["output_ids"]


def test_each_turn_is_the_prompt_built_afresh_from_the_recorded_last_turn(gw, chat_tokenizer):
    # The server remembers the text of the prompts it built and decodes only what a turn adds
    # (ChatTokenizer.decode_continued): the ids are those of the whole decode all the same.
    session_id, key = gw.start_session()
    messages, _ = _converse(gw.openai(key), gw.model, 6, max_tokens=12)
    turns = list(Interaction.objects.filter(session_id=session_id).order_by("turn"))
    assert all(t.prefix_reused for t in turns[1:])
    for previous, turn in zip(turns, turns[1:], strict=False):
        rebuilt = build_prompt(
            chat_tokenizer,
            turn.messages,
            None,
            PreviousTurn(
                messages=previous.messages,
                tools=previous.tools,
                input_ids=previous.input_ids,
                choices=[
                    {"output_ids": out["output_ids"], "message": choice["message"]}
                    for out, choice in zip(
                        previous.outputs, previous.response["choices"], strict=True
                    )
                ],
            ),
        )
        assert rebuilt.reused and rebuilt.input_ids == turn.input_ids
    assert turns[-1].messages == messages[:-2]
