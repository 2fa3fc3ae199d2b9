"""The tiny model builds locally and loads through the real Auto* classes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_core.tiny import IM_END, IM_START, TINY_VOCAB_SIZE, build_tiny_model


def test_tiny_model_loads_with_auto_classes(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (tiny_model_dir / "model.safetensors").exists()
    assert model.config.vocab_size == len(tok) == TINY_VOCAB_SIZE
    assert model.dtype == torch.float32
    assert tok.eos_token == IM_END
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert tok.eos_token_id in model.generation_config.eos_token_id
    ids = torch.tensor([tok("hello")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, 5, TINY_VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_tokenizer_round_trips_any_text_and_keeps_specials_whole(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Héllo, wörld! 🙂 tabs\tand\nnewlines"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # byte-level: token id == byte value
    assert tok.decode(ids) == text
    marked = tok(f"{IM_START}user\nhi{IM_END}")["input_ids"]
    assert marked[0] == tok.convert_tokens_to_ids(IM_START)
    assert marked[-1] == tok.eos_token_id


def test_chat_template_renders_roles_tools_and_generation_prompt(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calc", "arguments": '{"expr": "2+2"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "calc"' in text
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call><|im_end|>\n'
        in text
    )
    assert "<|im_start|>tool\n4<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert (
        plain
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )
    # Rendering is prefix-consistent across turns, which the gateway relies on.
    longer = tok.apply_chat_template(
        messages[:2] + [{"role": "assistant", "content": "4"}], tokenize=False
    )
    assert longer.startswith(plain)


def test_build_is_idempotent_and_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_model(tiny_model_dir)
    assert again == tiny_model_dir
    other = build_tiny_model(tmp_path / "other")
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(other).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name])
    seeded = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(tmp_path / "seed1", seed=1)
    ).state_dict()
    assert not torch.equal(a["lm_head.weight"], seeded["lm_head.weight"])


def test_cli_builds_a_model(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-m", "rl_core.tiny", str(tmp_path / "cli")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cli" / "tokenizer.json").exists()
    assert (tmp_path / "cli" / "chat_template.jinja").exists()


def test_the_kv_cache_goes_under_the_name_the_installed_transformers_takes(
    tiny_model_dir: Path,
) -> None:
    """transformers 5.2x renamed forward's ``past_key_values`` to ``cache`` (the old name warns,
    and goes in 5.40); the engine's decode loop must feed the cache back under either."""
    from rl_core.hf import cache_kwargs, returned_cache

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None): ...

    class Wrapped:  # a peft wrapper: forward(*args, **kwargs), the base model inside
        def get_base_model(self):
            return New()

    assert cache_kwargs(Old(), "kv") == {"past_key_values": "kv"}
    assert cache_kwargs(New(), "kv") == {"cache": "kv"}
    assert cache_kwargs(Wrapped(), "kv") == {"cache": "kv"}

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        whole = model(ids).logits[0, -1]
        first = model(ids[:, :3], use_cache=True)
        cache = returned_cache(first)
        assert cache is not None and cache.get_seq_length() == 3
        step = model(ids[:, 3:], use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]
    torch.testing.assert_close(step, whole, atol=1e-5, rtol=0)
