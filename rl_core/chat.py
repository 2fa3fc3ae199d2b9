"""Chat templates and tokenization without torch or transformers.

The gateway runs in the web process, which must not import torch (and
``transformers`` does). This module renders a model's own Jinja chat template
the way ``transformers``' ``apply_chat_template`` does (sandboxed Jinja with
``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and ``tojson``) and
tokenizes with the ``tokenizers`` library from the model directory's
``tokenizer.json``, so the ids match the trainer's tokenizer exactly.

Tool calls are parsed from generated text in the Hermes/Qwen format,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which ChatML
models (Qwen 2/2.5/3, SmolLM2, Hermes) use.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's template (e.g. an unsupported role)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@dataclass
class ChatTokenizer:
    """A model directory's tokenizer and chat template, usable from the web process."""

    tokenizer: Any  # tokenizers.Tokenizer
    template: jinja2.Template
    special_tokens: dict[str, str | None]
    eos_token_ids: list[int]
    path: str
    # render + encode, memoized (see encode_messages)
    _prompts: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)
    _prompts_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    PROMPT_CACHE_SIZE: ClassVar[int] = 2048

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTokenizer:
        from tokenizers import Tokenizer

        root = Path(path)
        if not (root / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{root} has no tokenizer.json; point base_model at a Hugging Face model directory."
            )
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        template_text = _chat_template(root, config)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        specials = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        return cls(
            tokenizer=tokenizer,
            template=env.from_string(template_text),
            special_tokens=specials,
            eos_token_ids=_eos_ids(root, tokenizer, specials["eos_token"]),
            path=str(root),
        )

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        try:
            return self.template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. "name: " + 5
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """``encode(render(messages, tools=tools))``, remembered for the last few thousand
        distinct prompts: RL sends one prompt many times (a group of samples per task, the
        same system prompt and task set every epoch), and rendering is deterministic (the
        template sees only the messages, the tools and the special tokens)."""
        key = orjson.dumps([messages, tools], option=orjson.OPT_SORT_KEYS)
        with self._prompts_lock:
            ids = self._prompts.get(key)
            if ids is not None:
                self._prompts.move_to_end(key)
                return list(ids)
        ids = self.encode(self.render(messages, tools=tools))
        with self._prompts_lock:
            self._prompts[key] = tuple(ids)
            if len(self._prompts) > self.PROMPT_CACHE_SIZE:
                self._prompts.popitem(last=False)
        return ids

    def encode(self, text: str) -> list[int]:
        # The template already wrote every special token, so none are added here.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@lru_cache(maxsize=16)
def load_chat_tokenizer(path: str) -> ChatTokenizer:
    """Cached per model directory: loading a real tokenizer takes ~100 ms."""
    return ChatTokenizer.from_pretrained(path)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split generated text into (content, OpenAI ``tool_calls``). Malformed calls stay as text."""
    calls = []
    for match in TOOL_CALL_RE.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except ValueError:
            continue
        name = payload.get("name") if isinstance(payload, dict) else None
        if not isinstance(name, str):
            continue
        arguments = payload.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    if not calls:
        return text, []
    content = TOOL_CALL_RE.sub("", text).strip()
    return content, calls


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _chat_template(root: Path, config: dict) -> str:
    # transformers 5 writes chat_template.jinja; older versions keep it in tokenizer_config.json.
    if (root / "chat_template.jinja").exists():
        return (root / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template and (root / "chat_template.json").exists():
        template = _read_json(root / "chat_template.json").get("chat_template")
    if not template:
        raise FileNotFoundError(f"{root} has no chat template; an instruct/chat model is needed.")
    return template


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _eos_ids(root: Path, tokenizer: Any, eos_token: str | None) -> list[int]:
    ids: list[int] = []
    for source in (_read_json(root / "generation_config.json"), _read_json(root / "config.json")):
        value = source.get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    if eos_token:
        token_id = tokenizer.token_to_id(eos_token)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids
