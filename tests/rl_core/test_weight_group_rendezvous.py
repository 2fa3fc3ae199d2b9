"""The torch engine joins a weight-update group as SGLang's server does, including one whose
trainer side waits for its workers at the rendezvous.

SGLang's own tests (and trainers built on its ``init_custom_process_group``) make rank 0's
store through ``torch.distributed.rendezvous``: a ``TCPStore`` master that waits until every
member has registered. A member that connects without registering leaves it waiting out its
timeout; the engine's member registers, so the group forms and the broadcast arrives.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_core.inference.client import InferenceClient
from rl_core.inference.process import free_port
from rl_core.inference.weight_group import DEFAULT_GROUP_NAME, dtype_name

PROMPT = [72, 101, 108, 108, 111, 44, 32]
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=60)


def serving_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied = getattr(model.config, "tie_word_embeddings", False)
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


class SGLangStyleTrainer(threading.Thread):
    """Rank 0 as SGLang's helper builds it: ``rendezvous`` (waits for its workers), then a
    gloo group over the same key prefixes, then one broadcast per tensor."""

    def __init__(self, port: int, tensors: dict[str, torch.Tensor]):
        super().__init__(daemon=True)
        self.port, self.tensors = port, tensors
        self.error: BaseException | None = None
        self.sent = 0

    def run(self) -> None:
        try:
            store, rank, world = next(
                dist.rendezvous(f"tcp://127.0.0.1:{self.port}", 0, 2, timeout=RENDEZVOUS_TIMEOUT)
            )
            prefixed = dist.PrefixStore(DEFAULT_GROUP_NAME, store)
            prefixed = dist.PrefixStore(f"{DEFAULT_GROUP_NAME}/", prefixed)
            prefixed = dist.PrefixStore("cpu/", prefixed)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = RENDEZVOUS_TIMEOUT
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            group = dist.ProcessGroupGloo(prefixed, rank, world, options)
            for tensor in self.tensors.values():
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                group.broadcast([tensor.contiguous()], opts).wait()
                self.sent += 1
        except BaseException as exc:  # reported by the test
            self.error = exc


async def test_the_engine_registers_with_a_rendezvous_that_waits_for_its_workers(
    torch_engine_factory: Any, perturbed_model_dir: Path, reference: Any
):
    engine = torch_engine_factory(weight_version=0)
    tensors = serving_tensors(perturbed_model_dir)
    port = free_port()
    trainer = SGLangStyleTrainer(port, tensors)
    trainer.start()
    async with InferenceClient(engine.url) as client:
        await client.init_weights_update_group(
            "127.0.0.1", port, 1, 2, backend="gloo", timeout_s=RENDEZVOUS_TIMEOUT.seconds
        )
        await client.update_weights_from_distributed(
            list(tensors),
            [dtype_name(t.dtype) for t in tensors.values()],
            [list(t.shape) for t in tensors.values()],
            weight_version=7,
        )
        await asyncio.to_thread(trainer.join, RENDEZVOUS_TIMEOUT.seconds)
        assert trainer.error is None, trainer.error
        assert trainer.sent == len(tensors)
        result = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
        assert set(result.versions) == {7}
        expected = reference.logprobs(perturbed_model_dir, PROMPT, result.output_ids)
        torch.testing.assert_close(
            torch.tensor(result.output_logprobs), expected, atol=2e-3, rtol=0
        )
        await client.destroy_weights_update_group()
