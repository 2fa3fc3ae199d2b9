"""A multi-agent run's publishing (``RoleAdapterSync``): every role's adapter is loaded on the
servers as ``<run>-<role>-v<N>`` at each version, and each answers with its own role's weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rl_core import lora
from rl_core.adapter_sync import RoleAdapterSync
from rl_core.inference.client import InferenceClient, InferenceError
from rl_core.trainer import PPOTrainer
from tests.rl_core.test_role_training import ROLES, _role_batch, _roles_cfg

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "


def _trainer_logprobs(trainer: Any, role: str, output: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + output])
    with torch.no_grad(), lora.active_adapter(trainer.model, role):
        logits = trainer.model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


async def _answer(client: InferenceClient, adapter: str | None) -> Any:
    return await client.generate(
        PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}, lora_path=adapter
    )


async def test_each_roles_adapter_is_served_under_its_own_name_and_answers_with_its_weights(
    torch_engine_factory, tiny_model_dir, tmp_path
):
    server = torch_engine_factory(weight_version=0, lora_rank=8)
    trainer = PPOTrainer(_roles_cfg(str(tiny_model_dir), learning_rate=5e-2))
    trainer.train_step(_role_batch(trainer, "speaker"))  # the listener's adapter stays at zero
    trainer.model.eval()
    # As on a shared pool: the servers are read at each push (once for every role), and the
    # run is told once of a server once every role's adapter is on it.
    refreshed, changes = [], []

    async def refresh() -> list[str]:
        refreshed.append(1)
        return [server.url]

    async def on_change(added: list[str], removed: list[str]) -> None:
        changes.append((added, removed))

    sync = RoleAdapterSync(
        [], tmp_path / "adapters", "run7", ROLES, keep=1, refresh=refresh, on_change=on_change
    )
    try:
        assert await sync.push(trainer) == 1
        assert len(refreshed) == 1 and changes == [([server.url], [])]
        assert sync.urls == [server.url]
        assert sync.current == {"speaker": "run7-speaker-v1", "listener": "run7-listener-v1"}
        assert sync.last_timing["weight_sync/bytes"] > 0
        async with InferenceClient(server.url) as client:
            speaker = await _answer(client, "run7-speaker-v1")
            listener = await _answer(client, "run7-listener-v1")
            base = await _answer(client, None)
            assert set(speaker.versions) == {1} and set(listener.versions) == {1}
            for role, got in (("speaker", speaker), ("listener", listener)):
                expected = _trainer_logprobs(trainer, role, got.output_ids)
                assert torch.allclose(torch.tensor(got.output_logprobs), expected, atol=2e-3)
            # Untrained, the listener answers as the base model; the speaker's answer moved.
            assert listener.output_ids == base.output_ids
            assert torch.allclose(
                torch.tensor(listener.output_logprobs),
                torch.tensor(base.output_logprobs),
                atol=2e-3,
            )
            on_same = _trainer_logprobs(trainer, "speaker", listener.output_ids)
            assert (on_same - torch.tensor(listener.output_logprobs)).abs().max() > 0.05

            trainer.train_step(_role_batch(trainer, "listener", seed=1))
            assert await sync.push(trainer) == 2
            assert len(refreshed) == 2 and len(changes) == 1
            await sync.drain()  # keep=1: version 1 of every role is unloaded
            for role in ROLES:
                with pytest.raises(InferenceError, match=f"not loaded: run7-{role}-v1"):
                    await client.generate(
                        PROMPT, {"max_new_tokens": 2}, lora_path=f"run7-{role}-v1"
                    )
                assert (await _answer(client, f"run7-{role}-v2")).versions[0] == 2
        for role in ROLES:
            assert [p.name for p in (tmp_path / "adapters" / role).iterdir()] == ["v2"]
            assert lora.is_lora_checkpoint(tmp_path / "adapters" / role / "v2")
    finally:
        await sync.unload_all()
        await sync.aclose()
