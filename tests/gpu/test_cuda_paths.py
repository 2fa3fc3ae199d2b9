"""The CUDA paths the CPU suite cannot reach, checked against CPU float32 references.

Skipped without a CUDA device (CI has none). On a lent GPU they run with only torch,
transformers and peft (no Django, no Ray), so they need neither conftest:

    python3 -m pytest --noconftest -p no:cacheprovider -o addopts= tests/gpu -q

- the trainer's packed attention on CUDA in bf16 autocast takes PyTorch's varlen flash kernel
  (``torch.nn.attention.varlen``) where this torch has one that serves grouped-query attention,
  and gives one-sequence-at-a-time logprobs and gradients either way;
- weights read from disk (``update_weights_from_disk``'s staged path) land on the device and
  the next answers are theirs;
- the torch engine on CUDA (batched right-padded prefill, the padded KV cache, per-row
  sampling on the CPU) reports the logprobs a CPU float32 forward gives for its tokens;
- a batch mixing two LoRA adapters and the base model on CUDA (the rank-stacked adapter
  matrices and their row mask) gives each row its own adapter's logprobs, as peft does.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

# STEEP_TEST_DEVICE=cpu runs the engine and LoRA checks on the CPU (to check the tests).
DEVICE = os.environ.get("STEEP_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)

PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [84, 104, 101], [49, 43, 50, 61, 51, 44, 32, 50, 43]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rl_core.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _cpu_logprobs(model_dir: Path, adapter: Path | None, prompt: list[int], output: list[int]):
    """Log-probs of ``output`` after ``prompt``: a CPU float32 forward (peft for an adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def _serve(engine: Any, tokenizer: Any, bodies: dict[str, dict]) -> dict[str, dict]:
    """Submit every body before the scheduler starts (one prefill, one batch); their results."""
    from rl_core.inference.torch_engine.protocol import parse_generate_request

    results: dict[str, dict] = {}
    done = threading.Event()
    for rid, body in bodies.items():
        req = parse_generate_request(
            {**body, "rid": rid, "return_logprob": True},
            tokenizer=tokenizer,
            vocab_size=engine.vocab_size,
        )

        def sink(payload: dict, final: bool, rid: str = rid) -> None:
            if final:
                results[rid] = payload
                if len(results) == len(bodies):
                    done.set()

        req.sink = sink
        engine.submit(req)
    engine.start()
    try:
        assert done.wait(120)
    finally:
        engine.stop()
    return results


def _logprobs(result: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]])


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA path of packed attention")
def test_packed_attention_on_cuda_matches_one_sequence_at_a_time():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rl_core import attention
    from rl_core.packing import pack, packed_logprobs
    from rl_core.types import Trajectory

    config = Qwen2Config(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    packed = AutoModelForCausalLM.from_config(
        config, attn_implementation=attention.register_packed_attention()
    ).cuda()
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda()
    ref.load_state_dict(packed.state_dict())
    g = torch.Generator().manual_seed(1)
    trajs = [
        Trajectory(
            input_ids=torch.randint(0, 300, (n,), generator=g).tolist(),
            loss_mask=[0, 0] + [1] * (n - 2),
            logprobs=[0.0] * n,
            versions=[-1, -1] + [0] * (n - 2),
            rewards=[1.0],
        )
        for n in (37, 5, 300, 64, 129)
    ]
    batch = pack(trajs).to("cuda")
    calls = []
    kernel = attention._varlen_attn()  # None where this torch's varlen_attn lacks GQA/windows

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return kernel(*args, **kwargs)

    original = attention._varlen_attn
    if kernel is not None:
        attention._varlen_attn = lambda: counted  # type: ignore[assignment]
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got, _ = packed_logprobs(packed, batch)
            got.sum().backward()
    finally:
        attention._varlen_attn = original  # type: ignore[assignment]
    # The kernel where torch has it; else causal SDPA once per sequence (torch 2.11 on an H200,
    # 2026-11-27: its varlen_attn lacks window_size or enable_gqa).
    assert bool(calls) == (kernel is not None)
    grad = torch.cat([p.grad.flatten() for p in packed.parameters()])
    for i, traj in enumerate(trajs):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want, _ = packed_logprobs(ref, pack([traj]).to("cuda"))
            want.sum().backward()
        start, end = batch.cu_seqlens[i].item(), batch.cu_seqlens[i + 1].item()
        torch.testing.assert_close(got[start:end].float(), want.float(), atol=0.05, rtol=0.02)
    want_grad = torch.cat([p.grad.flatten() for p in ref.parameters()])
    relative = (grad - want_grad).norm() / want_grad.norm()
    assert relative < 2e-2, relative


def test_the_engine_on_cuda_reports_the_logprobs_of_a_cpu_forward(tiny):
    from transformers import AutoTokenizer

    from rl_core.inference.torch_engine.engine import TorchEngine, load_model

    model = load_model(str(tiny), device=DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    engine = TorchEngine(model, tokenizer, model_path=str(tiny))
    bodies = {
        f"r{i}": {
            "input_ids": prompt,
            # ignore_eos: a seed picked on CPU logits may sample a stop token on CUDA's.
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 1.0,
                "sampling_seed": i,
                "ignore_eos": True,
            },
        }
        for i, prompt in enumerate(PROMPTS)  # three lengths: a right-padded batched prefill
    }
    results = _serve(engine, tokenizer, bodies)
    assert engine.stats["max_batch_size_seen"] == 3
    for i, prompt in enumerate(PROMPTS):
        result = results[f"r{i}"]
        assert result["meta_info"]["finish_reason"]["type"] == "length"
        expected = _cpu_logprobs(tiny, None, prompt, result["output_ids"])
        torch.testing.assert_close(_logprobs(result), expected, atol=2e-3, rtol=0)


def test_a_batch_mixing_two_adapters_and_the_base_model_on_cuda_matches_peft(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.inference.torch_engine.engine import TorchEngine, load_model
    from rl_core.inference.torch_engine.lora import AdapterSet

    adapters = {}
    for name, rank, targets in (("a", 8, "all-linear"), ("b", 4, ["q_proj", "v_proj"])):
        torch.manual_seed(rank)
        base = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
        peft = get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=2.0 * rank, target_modules=targets)
        )
        with torch.no_grad():
            for pname, param in peft.named_parameters():
                if "lora_B" in pname:
                    param.normal_(0.0, 0.2)
        peft.save_pretrained(str(tmp_path / name), save_embedding_layers=False)
        adapters[name] = tmp_path / name
    model = load_model(str(tiny), device=DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    lora = AdapterSet(model, max_lora_rank=8)
    engine = TorchEngine(model, tokenizer, model_path=str(tiny), adapters=lora)
    for name, path in adapters.items():
        lora.load(name, str(path))
    bodies: dict[str, dict] = {}
    for rid, name in (("ra", "a"), ("rb", "b"), ("rbase", None)):
        bodies[rid] = {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 3},
        }
        if name is not None:
            bodies[rid]["lora_path"] = name
    results = _serve(engine, tokenizer, bodies)
    assert engine.stats["max_batch_size_seen"] == 3  # one batch of three adapters
    for rid, name in (("ra", "a"), ("rb", "b"), ("rbase", None)):
        output = results[rid]["output_ids"]
        expected = _cpu_logprobs(tiny, adapters[name] if name else None, PROMPTS[0], output)
        torch.testing.assert_close(_logprobs(results[rid]), expected, atol=2e-3, rtol=0)


def test_weights_read_from_disk_are_installed_on_the_device_and_served(tiny, tmp_path):
    """``update_weights_from_disk``'s staged path: safetensors read into fresh memory like
    the served model's (on the device), swapped in by pointer; the next answers are the new
    weights' (a CPU float32 forward of the saved model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.inference.torch_engine.engine import TorchEngine, load_model
    from rl_core.inference.torch_engine.weight_load import read_staged

    torch.manual_seed(7)
    update = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    with torch.no_grad():
        for param in update.parameters():
            param.add_(0.05 * torch.randn_like(param))
    update.save_pretrained(str(tmp_path / "v1"))
    model = load_model(str(tiny), device=DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    engine = TorchEngine(model, tokenizer, model_path=str(tiny))
    staged = read_staged(str(tmp_path / "v1"), engine.model)
    assert all(t.device.type == torch.device(DEVICE).type for t in staged.values())
    engine.install_weights(staged, "1", str(tmp_path / "v1"))
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 5},
    }
    result = _serve(engine, tokenizer, {"r": body})["r"]
    assert result["meta_info"]["weight_version"] == "1"
    expected = _cpu_logprobs(tmp_path / "v1", None, PROMPTS[0], result["output_ids"])
    old = _cpu_logprobs(tiny, None, PROMPTS[0], result["output_ids"])
    torch.testing.assert_close(_logprobs(result), expected, atol=2e-3, rtol=0)
    assert (old - expected).abs().max() > 0.01  # the update mattered
