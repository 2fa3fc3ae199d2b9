"""A tiny Llama-style causal LM with a real tokenizer, built locally (no Hugging Face hub).

Tests, the demo and the embedded default run use it so that the real loading
code runs end to end (``AutoModelForCausalLM`` / ``AutoTokenizer`` from a
directory of safetensors, ``tokenizer.json`` and a chat template) on a laptop in
a second. The tokenizer is byte-level (every UTF-8 string round-trips) with
ChatML special tokens; its chat template renders system/user/assistant/tool
turns, assistant tool calls and a ``tools`` block.

Usage: ``python -m rl_core.tiny PATH`` (idempotent: an existing build is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

# Special tokens, in id order after the 256 byte tokens.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, PAD)
NUM_BYTE_TOKENS = 256
TINY_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)

# ChatML, as Qwen-style instruct models use it. Tool calls are rendered as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> inside the assistant turn and
# tool results as a `tool` turn, so the gateway can round-trip OpenAI tool calling.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set offset = 0 -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system_text = render_content(messages[0].content) -%}
{%- set offset = 1 -%}
{%- else -%}
{%- set system_text = '' -%}
{%- endif -%}
{%- if tools -%}
{{ '<|im_start|>system\\n' }}
{%- if system_text %}{{ system_text + '\\n\\n' }}{% endif -%}
{{ '# Tools\\n\\nYou may call one or more functions. Their signatures are inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor -%}
{{ '\\n</tools>\\n\\nFor each call, reply with <tool_call>{"name": <name>, "arguments": <json object>}</tool_call>.<|im_end|>\\n' }}
{%- elif offset == 1 -%}
{{ '<|im_start|>system\\n' + system_text + '<|im_end|>\\n' }}
{%- endif -%}
{%- for message in messages[offset:] -%}
{%- if message.role == 'assistant' -%}
{{ '<|im_start|>assistant\\n' + render_content(message.content) }}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if (message.content and loop.first) or not loop.first %}{{ '\\n' }}{% endif -%}
{{ '<tool_call>{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif -%}
{{ '}</tool_call>' }}
{%- endfor -%}
{{ '<|im_end|>\\n' }}
{%- elif message.role in ['user', 'system', 'tool'] -%}
{{ '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
{%- else -%}
{{ raise_exception('Unknown message role: ' + message.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}
"""

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _byte_to_unicode() -> dict[int, str]:
    # The printable stand-in ByteLevel uses for each byte (GPT-2's reversible mapping):
    # printable Latin-1 bytes map to themselves, the others to U+0100 onwards.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_tokenizer():
    """A byte-level BPE with no merges: one token per byte, plus the ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: byte for byte, ch in _byte_to_unicode().items()}  # token id == byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _make_tokenizer_config_portable(config_path: Path) -> None:
    # transformers 5 writes its own class name, which 4.x (what SGLang pins on GPU
    # machines) cannot resolve; both resolve PreTrainedTokenizerFast.
    cfg = json.loads(config_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = [ENDOFTEXT, IM_START]
    config_path.write_text(json.dumps(cfg, indent=2) + "\n")


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 2048,
    init_std: float = 0.2,
    head_init_std: float = 0.8,
    seed: int = 0,
) -> Path:
    """Build the tiny model and tokenizer into ``path`` and return it; keep an existing build.

    The vocabulary is fixed (256 bytes + 4 specials = ``TINY_VOCAB_SIZE``). The output
    head is initialised with ``head_init_std`` (much larger than a real model's) so
    next-token distributions are peaked (entropy ~1.6 nats) rather than uniform: greedy
    decoding then has clear winners, which batched-vs-single equality tests rely on,
    and sampling still varies. Building is atomic (written to a sibling temp dir, then
    renamed), so concurrent builders never see a half-written model.
    """
    path = Path(path)
    if all((path / name).exists() for name in _REQUIRED_FILES):
        return path

    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_tokenizer(),
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[ENDOFTEXT, IM_START],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    tok.model_max_length = max_positions
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}  # type: ignore[arg-type]
    assert len(tok) == TINY_VOCAB_SIZE, len(tok)

    eos_ids = [ids[IM_END], ids[ENDOFTEXT]]
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()  # float32 by default
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_init_std)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=ids[PAD], bos_token_id=None
    )

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _make_tokenizer_config_portable(tmp / "tokenizer_config.json")
        try:
            tmp.rename(path)
        except OSError:
            # Another builder won the race (or a partial dir exists): keep a complete one.
            if not all((path / name).exists() for name in _REQUIRED_FILES):
                shutil.rmtree(path, ignore_errors=True)
                tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build Steep's tiny test model into PATH.")
    parser.add_argument("path")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.path, hidden=args.hidden, layers=args.layers, seed=args.seed))


if __name__ == "__main__":
    main()
