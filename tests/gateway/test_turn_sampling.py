"""A turn's sampling settings are recorded, and its tokens reach training at its temperature."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from webapp.gateway.models import Interaction, Session
from webapp.gateway.selectors import session_trajectories

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]


def _settings(interaction_id: str) -> tuple[float, float, int]:
    turn = Interaction.objects.get(pk=interaction_id)
    return turn.temperature, turn.top_p, turn.top_k


def test_a_turn_records_its_temperature_top_p_and_top_k(gw):
    completion = gw.openai().chat.completions.create(
        model=gw.model,
        messages=HI,
        max_tokens=4,
        temperature=0.5,
        top_p=0.9,
        extra_body={"top_k": 5},  # SGLang's and vLLM's extension of OpenAI's body
    )
    assert _settings(completion.id) == (0.5, 0.9, 5)
    assert Interaction.objects.get(pk=completion.id).sampling["top_k"] == 5


def test_a_turn_without_sampling_settings_records_the_defaults(gw):
    completion = gw.openai().chat.completions.create(model=gw.model, messages=HI, max_tokens=4)
    assert _settings(completion.id) == (1.0, 1.0, -1)
    zero_k = gw.openai().chat.completions.create(
        model=gw.model, messages=HI, max_tokens=4, extra_body={"top_k": 0}
    )
    assert _settings(zero_k.id) == (1.0, 1.0, -1)  # 0 and -1 both mean no top-k


@pytest.mark.parametrize("top_k", ["5", 2.5, -2, True])
def test_a_bad_top_k_is_refused_naming_it(gw, openai_error, top_k):
    response = gw.post("/chat/completions", {"model": gw.model, "messages": HI, "top_k": top_k})
    assert openai_error(response, 400)["param"] == "top_k"


def test_a_sessions_trajectory_carries_each_turns_temperature_and_tempered_logprobs(
    gw, tiny_model_dir
):
    """Three turns at 0.5, greedy and 1.5: each output token's behaviour logprob is
    log_softmax(logits / T) of the served model, and the trajectory says which T."""
    session_id, key = gw.start_session()
    client = gw.openai(key)
    messages: list = [{"role": "user", "content": "Hi"}]
    for turn, temperature in enumerate([0.5, 0.0, 1.5]):
        completion = client.chat.completions.create(
            model=gw.model, messages=messages, max_tokens=6, temperature=temperature, seed=turn
        )
        messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": f"And {turn}?"},
        ]
    assert gw.post("/rl/set_reward", {"reward": 1.0}, key=key).status_code == 200
    assert gw.post("/rl/end_session", key=key).status_code == 200

    turns = list(Interaction.objects.filter(session_id=session_id).order_by("turn"))
    assert [t.temperature for t in turns] == [0.5, 0.0, 1.5]
    [trajectory] = session_trajectories(Session.objects.get(pk=session_id))
    expected_temps = [1.0] * len(trajectory.input_ids)  # prompt tokens: 1.0
    for turn, logprob_temperature in zip(turns, [0.5, 1.0, 1.5], strict=True):  # greedy: 1.0
        start = len(turn.input_ids)
        n = len(turn.outputs[turn.chosen]["output_ids"])
        expected_temps[start : start + n] = [logprob_temperature] * n
    assert trajectory.temperatures == expected_temps

    # An independent forward pass of the served model, each row divided by its token's T.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([trajectory.input_ids])  # [1, L]
    temps = torch.tensor(trajectory.temperatures)  # [L]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1] / temps[1:, None], -1)  # [L-1, V]
    expected = logp.gather(-1, ids[0, 1:, None])[:, 0]  # [L-1]: logprob of token t+1
    mask = torch.tensor(trajectory.loss_mask[1:], dtype=torch.bool)
    assert_close(torch.tensor(trajectory.logprobs[1:])[mask], expected[mask], atol=2e-3, rtol=0)
