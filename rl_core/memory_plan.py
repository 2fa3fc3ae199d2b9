"""Memory plans: what one trainer rank holds for a model too big for this machine, found by
running the trainer's own code on fake tensors.

A plan builds the model from its ``transformers`` config under ``FakeTensorMode`` (tensors with
shapes and dtypes and no storage), shards it with FSDP2 (``rl_core.distributed.shard_model``)
over a fake process group of N ranks (collectives that move nothing, in this one process), and
runs one training micro-step as the trainer does on a GPU: float32 master weights sharded,
bf16 compute (FSDP2's mixed precision), the trainer's ``packed_logprobs`` (chunked from the
hidden states, or from the whole ``[T, V]`` logits), a loss, the backward and an AdamW step.
torch's ``FSDPMemTracker`` counts every tensor's bytes by kind (sharded and gathered
parameters, gradients, optimizer state, activations, temporaries) and the step's peak. Nothing
is allocated: a 32B plan runs on a laptop in seconds.

What a plan leaves out: the CUDA caching allocator's fragmentation and reserve, kernels'
workspaces, NCCL buffers, and the CUDA context (~0.5-1 GB): the GPU's own peak is higher by
those (``docs/deploy.md`` adds a margin).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

# Qwen2 / Qwen2.5 shapes (their config.json files): the sizes the sizing table plans.
QWEN2: dict[str, dict[str, Any]] = {
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "14b": {
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "32b": {
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}


def qwen2_config(size: str) -> Any:
    """A Qwen2 config of ``size`` (a key of ``QWEN2``) with Steep's packed attention."""
    from transformers import Qwen2Config

    from rl_core.attention import register_packed_attention

    config = Qwen2Config(**QWEN2[size], max_position_embeddings=32768)
    config._attn_implementation = register_packed_attention()
    return config


@dataclass
class MemoryPlan:
    """One rank's memory for one training micro-step, in bytes."""

    world_size: int
    tokens: int
    parameters: int  # the model's parameters (all ranks together)
    trainable: int  # of which trained (all of them, or the adapter's)
    sharded_parameters: int  # this rank's shard of the float32 master weights
    gradients: int  # this rank's shard of the gradients
    optimizer: int  # this rank's AdamW state
    peak: int  # the step's peak: all of the above plus activations, gathered layers, temporaries
    by_kind: dict[str, int] = field(default_factory=dict)  # FSDPMemTracker's kinds at the peak

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state: what a rank holds between steps."""
        return self.sharded_parameters + self.gradients + self.optimizer


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) and its device
    mesh; the default group while inside. Refused when a real group is initialised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised: plan in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def plan_step(
    config: Any,
    *,
    world_size: int,
    tokens: int,
    sequence_length: int = 4096,
    lora_rank: int = 0,
    checkpointing: bool = False,
    chunked: bool = True,
    chunk_tokens: int = 1024,
    fake: bool = True,
) -> MemoryPlan:
    """The memory of one rank training one micro-batch of ``tokens`` tokens (sequences of
    ``sequence_length``) on ``config``'s model, FSDP2 over ``world_size`` ranks.

    ``fake=False`` runs the same step on real tensors (a model small enough for this
    machine): how the tests check that the fake tensors count what real ones hold."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from rl_core.distributed import shard_model
    from rl_core.memory import enable_activation_checkpointing
    from rl_core.packing import pack, packed_logprobs
    from rl_core.types import Trajectory

    lengths = [sequence_length] * (tokens // sequence_length)
    if tokens % sequence_length:
        lengths.append(tokens % sequence_length)
    batch = pack(
        [Trajectory([0] * n, [0] + [1] * (n - 1), [0.0] * n, [0] * n, [1.0]) for n in lengths]
    )
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with fake_process_group(world_size) as mesh, mode or contextlib.nullcontext():
        model = _build(config, lora_rank, mode)
        if checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        shard_model(model, param_dtype=torch.bfloat16, mesh=mesh)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-6)
        mask = batch.loss_mask.float()  # [T]

        def step() -> None:
            logprobs, _ = packed_logprobs(
                model,
                batch,
                with_entropy=True,
                entropy_grad=False,  # the default entropy_coef 0 logs it without its graph
                chunk_tokens=chunk_tokens,
                from_hidden=chunked,
            )
            (-(logprobs * mask).sum() / mask.sum()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # as the trainer does

        step()  # AdamW makes its moments: the measured step is a run's steady state
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")
        counted = next(iter(peak.values())) if peak else {}
        state = _state_bytes(model, optimizer)
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in params)
    return MemoryPlan(
        world_size=world_size,
        tokens=tokens,
        parameters=total,
        trainable=trainable,
        sharded_parameters=state["parameters"],
        gradients=state["gradients"],
        optimizer=state["optimizer"],
        peak=int(counted.get("Total", 0)),
        by_kind={str(k): int(v) for k, v in counted.items() if k != "Total"},
    )


def _build(config: Any, lora_rank: int, mode: Any) -> torch.nn.Module:
    """The model in float32 (with a LoRA adapter of ``lora_rank`` on every linear layer),
    of fake tensors in ``mode``, or real ones when ``mode`` is None."""
    from transformers import AutoModelForCausalLM

    def build() -> torch.nn.Module:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if lora_rank:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear")
            model = get_peft_model(model, lora)
        return model

    if mode is None:
        return build()
    # Built on the meta device, then every parameter and buffer made a fake tensor: peft
    # moves its adapters with ``Module.to``, which cannot swap fake tensors in place.
    with torch.device("meta"), unset_fake_temporarily():
        model = build()
    cpu, fakes = torch.device("cpu"), {}  # one fake per tensor: tied weights stay tied
    converter = mode.fake_tensor_converter

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            fakes[id(tensor)] = converter.from_meta_and_device(mode, tensor, cpu)
        return fakes[id(tensor)]

    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in params:
                    params[id(param)] = torch.nn.Parameter(fake(param), param.requires_grad)
                module._parameters[name] = params[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = fake(buffer)
    return model


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's shards of the parameters, gradients (one per trained parameter, of its
    dtype, while a step runs) and AdamW state."""
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p) for p in model.parameters() if p.requires_grad)
    moments = sum(
        _local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    return {"parameters": params, "gradients": grads, "optimizer": moments}
