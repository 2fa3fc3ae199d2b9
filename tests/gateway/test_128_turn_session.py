"""A 128-turn session through the gateway (issue 36), with a sub-agent's fork inside it: every turn
extends the last one's exact tokens by only what it added, its row stores only that, the engine
reuses the last turn's KV, and the session trains as one trajectory per branch, longer than a
micro-batch, and renders a page at a time."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from rl_core.chat import load_chat_tokenizer
from rl_core.config import RunConfig
from rl_core.inference.launch import TorchEngineServer
from rl_core.tiny import build_tiny_model
from webapp.gateway.models import Interaction, Session
from webapp.gateway.selectors import session_trajectories

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TURNS, FORK_AT, FORKED_FROM = 128, 64, 60


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """The tiny model at 8,192 positions: 128 turns of a byte-level chat hold ~4,500 tokens."""
    return str(build_tiny_model(tmp_path_factory.mktemp("long") / "tiny-8k", max_positions=8192))


@pytest.fixture(scope="module")
def long_engine(long_model, tmp_path_factory):
    server = TorchEngineServer(
        long_model,
        host="127.0.0.1",
        weight_version=0,
        num_threads=1,
        log_path=tmp_path_factory.mktemp("engine") / "engine.log",
    )
    server.start()
    server.wait_healthy(timeout=120)
    yield server
    server.stop()


def test_a_128_turn_session_is_recorded_trained_and_rendered(
    make_gateway, project, api_key, long_engine, long_model, member_client
):
    gw = make_gateway(project, api_key, servers=[long_engine.url], model_dir=long_model)
    session_id, key = gw.start_session()
    client = gw.openai(key)
    messages: list[dict] = [{"role": "system", "content": "Answer briefly."}]
    conversations = []  # the messages each main-line turn sent, and its answer
    for turn in range(TURNS):
        if turn == FORK_AT:  # a sub-agent takes the conversation as it was at turn 60
            sent, _ = conversations[FORKED_FROM]
            forked = [*sent, {"role": "assistant", "content": conversations[FORKED_FROM][1]}]
            client.chat.completions.create(
                model=gw.model,
                messages=[*forked, {"role": "user", "content": "Sub-task: check it."}],
                max_tokens=4,
                seed=1000,
            )
        messages.append({"role": "user", "content": f"Step {turn}."})
        completion = client.chat.completions.create(
            model=gw.model, messages=messages, max_tokens=4, seed=turn
        )
        answer = completion.choices[0].message.content
        conversations.append((list(messages), answer))
        messages.append({"role": "assistant", "content": answer})
    gw.post("/rl/set_reward", {"reward": 1.0}, key=key)
    gw.post("/rl/end_session", key=key)

    # Recorded: each main-line turn is the last one's exact tokens and answer, then only what
    # it added (the template's rendering of the new message), and its row holds only that.
    session = Session.objects.get(pk=session_id)
    rows = list(Interaction.objects.filter(session=session).order_by("turn"))  # read whole
    assert len(rows) == TURNS + 1
    main = [row for row in rows if row.turn != FORK_AT]
    tok = load_chat_tokenizer(long_model)
    for before, row in zip(main, main[1:], strict=False):
        seen = before.input_ids + before.outputs[0]["output_ids"]
        assert row.input_ids[: len(seen)] == seen and row.prefix_reused
        added = row.input_ids[len(seen) :]
        assert 0 < len(added) < 40, len(added)
    last_sent, _ = conversations[-1]
    assert tok.decode(main[-1].input_ids, skip_special_tokens=False) == tok.render(last_sent)
    fork = rows[FORK_AT]
    parent = rows[FORKED_FROM]
    assert fork.input_ids[: len(parent.input_ids)] == parent.input_ids
    stored = (
        Interaction.objects.filter(session=session)
        .order_by("turn")
        .values_list("turn", "prefix_turn", "messages", "input_ids")
    )
    prefix_turns = {turn: prefix for turn, prefix, _, _ in stored}
    assert prefix_turns[FORK_AT] == FORKED_FROM and prefix_turns[FORK_AT + 1] == FORK_AT - 1
    assert all(prefix_turns[t] == t - 1 for t in range(1, FORK_AT))
    sizes = [len(json.dumps(m)) + len(json.dumps(ids)) for _, _, m, ids in stored]
    whole = len(json.dumps(last_sent)) + len(json.dumps(main[-1].input_ids))
    assert max(sizes[1:]) < 400 < 30_000 < whole  # a row the size of a turn, not the session

    # The engine prefilled only what each turn added (its prefix cache).
    info = httpx.get(long_engine.url + "/server_info", timeout=30).json()["internal_states"][0]
    assert info["num_prefix_cache_hits"] >= TURNS - 2

    # Trained: the main line and the sub-agent's branch, each one trajectory, the main one
    # longer than a micro-batch.
    trajectories = session_trajectories(session)
    assert len(trajectories) == 2
    longest = max(trajectories, key=lambda t: len(t.input_ids))
    assert longest.input_ids == main[-1].input_ids + main[-1].outputs[0]["output_ids"]
    assert len(longest.turn_spans()) == TURNS and sum(longest.loss_mask) >= TURNS
    cfg = RunConfig.from_dict(
        {
            "base_model": long_model,
            "mode": "online",
            "batch_size": 2,
            "micro_batch_tokens": 1024,
            "learning_rate": 1e-2,
        }
    )
    assert len(longest.input_ids) > 4 * cfg.micro_batch_tokens
    from rl_core.trainer import PPOTrainer

    trainer = PPOTrainer(cfg)
    shorter = min(trajectories, key=lambda t: len(t.input_ids))
    shorter.rewards = [0.0] * len(shorter.rewards)  # the two branches' rewards differ
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.train_step(trajectories)
    assert torch.isfinite(torch.tensor(stats["ppo/loss"]))
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed

    # Rendered a page at a time: the latest twenty turns by default.
    page = member_client.get(f"/projects/{project.id}/sessions/{session_id}/")
    assert page.status_code == 200
    body = page.content.decode()
    assert f"{TURNS + 1} turns, 20 a page:" in body and '<b aria-current="page">120–128</b>' in body
    assert body.count('<article class="turn"') == 9
