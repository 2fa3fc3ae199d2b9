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
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rl_core.jsonbytes import json_bytes

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's template (e.g. an unsupported role)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with ``message.role`` on a plain dict looked up as the key at once.

    The sandbox tries the attribute first and takes the key when that raises, and a template
    does this for every message's every field: a third of a render went to the raised
    ``AttributeError``. A plain dict has no attribute but its class's, so for any other name
    the answer is the same: the item, or undefined.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """A macro the template defines, called as ``Context.call`` would (with the eval
        context, without the loop and block variables), minus the sandbox's and the context's
        checks, which find a template's own macro safe and taking the eval context every time:
        a template that renders each message's content through a macro (Qwen's, the tiny
        model's) spent a third of its render on them. Anything else goes through both."""
        if type(__obj) is Macro:
            kwargs.pop("_loop_vars", None)
            kwargs.pop("_block_vars", None)
            try:
                return __obj(__context.eval_ctx, *args, **kwargs)
            except StopIteration:  # as Context.call answers it
                return __self.undefined(
                    "value was undefined because a callable raised a StopIteration exception"
                )
        return super().call(__context, __obj, *args, **kwargs)


def compile_template(
    text: str, environment: type[ImmutableSandboxedEnvironment] = _TemplateEnvironment
) -> jinja2.Template:
    """A chat template compiled as ``transformers`` does (``environment``: for tests)."""
    env = environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    template = env.from_string(text)
    # A plain dict, not the ChainMap over the environment's globals: every render copies
    # them into its context, and iterating a ChainMap is a Python loop.
    template.globals = dict(template.globals)
    return template


@dataclass(frozen=True)
class ToolSupport:
    """Whether a chat template renders the ``tools`` it is given, assistant ``tool_calls``
    and ``tool`` messages (``ChatTokenizer.tool_support``)."""

    tools: bool
    calls: bool
    results: bool


_PROBE_NAME = "steep_probe_fn_5d1c"
_PROBE_TEXT = "steep_probe_result_5d1c"
_PROBE_TOOL: dict = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "d",
        "parameters": {"type": "object", "properties": {}},
    },
}
_PROBE_CALL: list[dict] = [
    {"role": "user", "content": "u"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}
        ],
    },
]
_PROBE_RESULT: list[dict] = [
    *_PROBE_CALL,
    {"role": "tool", "tool_call_id": "call_0", "name": _PROBE_NAME, "content": _PROBE_TEXT},
]

# Steep's own rendering of tools for a template without (the Hermes / Qwen format, which
# parse_tool_calls reads back).
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_text(tools: list[dict]) -> str:
    """The tool schemas as Steep writes them into the system message: one JSON per line."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PREAMBLE + lines + TOOLS_POSTAMBLE


def tool_call_text(call: dict) -> str:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` for an OpenAI tool call
    (its arguments a JSON string or an object): what ``parse_tool_calls`` reads back."""
    function = call.get("function", call) if isinstance(call, dict) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # kept as the string it is
    payload = {"name": function.get("name"), "arguments": arguments}
    return f"<tool_call>{json.dumps(payload, ensure_ascii=False)}</tool_call>"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else str(content)


def steep_tool_messages(
    messages: list[dict], tools: list[dict] | None, support: ToolSupport
) -> tuple[list[dict], list[dict] | None]:
    """``messages`` and ``tools`` as the template is given them: content ``None`` as ``""``;
    where the template renders no tools, the schemas in the system message (``tools_text``);
    no tool calls, each as ``tool_call_text`` after the assistant's content; no tool results,
    each as a user turn of ``<tool_response>`` blocks (consecutive results in one turn)."""
    out: list[dict] = []
    merged_results = False  # the last message out is a user turn of tool responses
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        calls = message.get("tool_calls") or []
        if calls and not support.calls:
            texts = [_text(message["content"])] if _text(message["content"]) else []
            message["content"] = "\n".join(texts + [tool_call_text(c) for c in calls])
            message.pop("tool_calls", None)
        if message.get("role") == "tool" and not support.results:
            block = f"<tool_response>\n{_text(message['content'])}\n</tool_response>"
            if merged_results:
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block})
            merged_results = True
            continue
        merged_results = False
        out.append(message)
    if tools and not support.tools:
        block = tools_text(tools)
        if out and out[0].get("role") == "system":
            system = _text(out[0]["content"])
            out[0] = {**out[0], "content": f"{system}\n\n{block}" if system else block}
        else:
            out.insert(0, {"role": "system", "content": block})
        tools = None
    return out, tools


@dataclass
class ChatTokenizer:
    """A model directory's tokenizer and chat template, usable from the web process."""

    tokenizer: Any  # tokenizers.Tokenizer
    template: jinja2.Template
    special_tokens: dict[str, str | None]
    eos_token_ids: list[int]
    path: str
    byte_level: bool = False  # the decoder is ByteLevel's alone (see joins)
    special_ids: frozenset[int] = frozenset()  # ids of the special added tokens
    # render + encode, memoized (see encode_messages)
    _prompts: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)
    _prompts_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # key → (number of ids, their text), most recent last (see decode_continued)
    _texts: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)
    _texts_chars: int = field(default=0, repr=False, compare=False)
    _tool_support: ToolSupport | None = field(default=None, repr=False, compare=False)
    _local: bool | None = field(default=None, repr=False, compare=False)  # see renders_locally

    PROMPT_CACHE_SIZE: ClassVar[int] = 2048
    TEXT_CACHE_CHARS: ClassVar[int] = 1 << 24  # remembered texts, in characters, at most

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTokenizer:
        from tokenizers import Tokenizer, decoders

        root = Path(path)
        if not (root / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{root} has no tokenizer.json; point base_model at a Hugging Face model directory."
            )
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        specials = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        return cls(
            tokenizer=tokenizer,
            template=compile_template(_chat_template(root, config)),
            special_tokens=specials,
            eos_token_ids=_eos_ids(root, tokenizer, specials["eos_token"]),
            path=str(root),
            byte_level=isinstance(tokenizer.decoder, decoders.ByteLevel),
            special_ids=frozenset(
                i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
            ),
        )

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of ``messages`` (and ``tools``) by the model's template. Content
        ``None`` is rendered as empty text; what the template cannot render of tools, tool
        calls and tool results Steep writes itself (``tool_support``, ``steep_tool_messages``)."""
        messages, tools = steep_tool_messages(messages, tools, self.tool_support())
        return self._render(messages, tools, add_generation_prompt)

    def tool_support(self) -> ToolSupport:
        """What the template renders of tools, assistant tool calls and tool results: found
        once, by rendering probes (a name or a text it must write out if it uses them)."""
        if self._tool_support is None:
            self._tool_support = ToolSupport(
                tools=self._probe([{"role": "user", "content": "u"}], [_PROBE_TOOL]),
                calls=self._probe(_PROBE_CALL, None),
                results=self._probe(_PROBE_RESULT, None, _PROBE_TEXT),
            )
        return self._tool_support

    def render_tail(
        self, earlier: list[dict], later: list[dict], tools: list[dict] | None = None
    ) -> tuple[str, str] | None:
        """``(head, text)``: ``head`` is the rendering of a short stand-in for ``earlier`` (with
        the generation prompt) and ``text`` that of the stand-in followed by ``later``. What
        ``render(earlier + later)`` writes after ``render(earlier)`` and the answer that opens
        ``later`` is what ``text`` writes after ``head`` and that answer: a session's turn
        renders what it added, not the conversation so far. None when the template's
        rendering of a message depends on more than the messages next to it
        (``renders_locally``): then the whole conversation must be rendered."""
        if not earlier or not self.renders_locally():
            return None
        context = stand_in(earlier)
        return self.render(context, tools=tools), self.render(context + later, tools=tools)

    def renders_locally(self) -> bool:
        """Whether ``render_tail`` holds for this template: checked once, on probe
        conversations (with and without a system message, with tool calls and results)."""
        if self._local is None:
            self._local = all(self._tail_agrees(*probe) for probe in _LOCALITY_PROBES)
        return self._local

    def _tail_agrees(self, earlier: list[dict], later: list[dict], tools: list | None) -> bool:
        try:
            head, whole = (
                self.render(earlier, tools=tools),
                self.render(earlier + later, tools=tools),
            )
            context = stand_in(earlier)
            short = self.render(context, tools=tools)
            longer = self.render(context + later, tools=tools)
        except ChatTemplateError:
            return False
        return (
            whole.startswith(head)
            and longer.startswith(short)
            and whole[len(head) :] == longer[len(short) :]
        )

    def _probe(self, messages: list[dict], tools: list[dict] | None, needle: str = "") -> bool:
        try:
            text = self._render(messages, tools, False)
        except ChatTemplateError:
            return False
        return (needle or _PROBE_NAME) in text

    def _render(
        self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool
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
        key = json_bytes([messages, tools], sort_keys=True)
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

    def joins(self, text: str) -> bool:
        """Whether ids whose text is ``text`` followed by any ``more`` decode (special tokens
        kept) to ``text + decode(more)``.

        True for a byte-level decoder (GPT-2's, Qwen's, Llama 3's) when ``text`` is empty or
        ends with an ASCII character. Such a decoder decodes the ids' token bytes, one after
        the other, as UTF-8 (U+FFFD for bytes that are not); a text ending in ASCII comes from
        bytes ending in that ASCII byte (a cut-off or invalid sequence would end it with
        U+FFFD), and no UTF-8 sequence runs across an ASCII byte, so what follows decodes on
        its own. Other decoders (Metaspace, WordPiece, none) strip or join tokens across the
        cut: never assumed.
        """
        return self.byte_level and (not text or text[-1] < "\x80")

    def remember_text(self, key: str, count: int, text: str) -> None:
        """Remember ``text``, the decoding (special tokens kept) of ``count`` ids, under
        ``key``, which names those ids for good (a recorded turn's interaction id)."""
        with self._prompts_lock:
            old = self._texts.pop(key, None)
            if old is not None:
                self._texts_chars -= len(old[1])
            self._texts[key] = (count, text)
            self._texts_chars += len(text)
            while self._texts_chars > self.TEXT_CACHE_CHARS and self._texts:
                self._texts_chars -= len(self._texts.popitem(last=False)[1][1])

    def remembered(self, key: str | None, count: int) -> str | None:
        """The text of ``count`` ids remembered under ``key`` (``remember_text``), if it is."""
        if key is None:
            return None
        with self._prompts_lock:
            found = self._texts.get(key)
            if found is not None:
                self._texts.move_to_end(key)
        return found[1] if found is not None and found[0] == count else None

    def decode_continued(self, key: str | None, ids: list[int], more: list[int]) -> str:
        """``decode(ids + more, skip_special_tokens=False)``. When the text of ``ids`` was
        remembered under ``key`` (``remember_text``) and ``joins`` it, only ``more`` is decoded:
        a session's next turn decodes its last answer, not the whole conversation again."""
        known = self.remembered(key, len(ids))
        if known is not None and self.joins(known):
            return known + self.decode(more, skip_special_tokens=False)
        return self.decode(ids + more, skip_special_tokens=False)


def stand_in(messages: list[dict]) -> list[dict]:
    """A short conversation rendered like ``messages`` at its start and its end: the first
    message (a system prompt, or the first user turn) and the last one or two, so that every
    message keeps the parity of its position (templates that check that roles alternate do so
    by index)."""
    if len(messages) <= 3:
        return list(messages)
    return [messages[0], *messages[-1 - len(messages) % 2 :]]


def _conversation(system: bool, pairs: int) -> list[dict]:
    head = [{"role": "system", "content": "Be brief."}] if system else []
    for i in range(pairs):
        head += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return [*head, {"role": "user", "content": "last"}]


_PROBE_CALLED = {**_PROBE_CALL[1], "content": None}
# (earlier, later, tools): ``later`` opens with the answer to ``earlier``, as a turn's does.
_LOCALITY_PROBES: list[tuple[list[dict], list[dict], list | None]] = [
    (
        _conversation(True, 3),
        [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
        None,
    ),
    (
        _conversation(False, 3),
        [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
        None,
    ),
    (
        _conversation(False, 4),
        [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
        None,
    ),
    (
        [
            *_conversation(True, 2),
            _PROBE_CALLED,
            _PROBE_RESULT[2],
            {"role": "assistant", "content": "r"},
            {"role": "user", "content": "u2"},
        ],
        [_PROBE_CALLED, _PROBE_RESULT[2], {**_PROBE_RESULT[2], "content": "second"}],
        [_PROBE_TOOL],
    ),
]


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
