"""The gateway's template sandbox (``rl_core.chat.compile_template``) renders exactly as the plain
``ImmutableSandboxedEnvironment`` does: same text, same refusals, same errors."""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rl_core.chat import compile_template

# Qwen 2.5's way with tools and tool results (abridged), written with attribute access.
CHATML_TOOLS = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- elif message.role == 'assistant' %}
<|im_start|>assistant{% if message.content %}
{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# Llama 3's way: subscripts, ``.get`` and string methods.
LLAMA = """{{ bos_token }}{% for message in messages %}
{%- set content = message['content'] if message['content'] is string else '' %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content | trim + '<|eot_id|>' }}
{%- if message.get('name') %}({{ message.get('name') }}){% endif %}
{%- endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\\n\\n{% endif %}"""

# What a template may ask a message besides its fields: dict methods, absent keys, tests.
PROBES = """{% for message in messages %}
[{{ message.items() | list | length }} {{ message.keys() | list | sort | join(',') }}
{{ message.get('name', '-') }} {{ message.name is defined }} {{ message.absent | default('?') }}
{{ message.values is defined }} {{ message['role'] }} {{ message.content is none }}]
{%- endfor %}"""

# Macros every way a template may call them (the sandbox's fast path for a template's macros):
# defaults, keywords, varargs and kwargs, caller blocks, one macro calling another, inside loops.
MACROS = """{%- macro text(content, prefix='') -%}
{%- if content is string %}{{ prefix }}{{ content }}{% else %}{% for p in content or [] %}{{ p.text }}{% endfor %}{% endif -%}
{%- endmacro -%}
{%- macro tag(role) -%}<{{ role }}>{{ caller() }}</{{ role }}>{%- endmacro -%}
{%- macro many() -%}{{ varargs | length }}:{{ kwargs | dictsort | join(',') }}{%- endmacro -%}
{%- macro nested(m) -%}[{{ text(m.content, prefix=m.role ~ ': ') }}]{%- endmacro -%}
{%- for message in messages -%}
{%- set n = loop.index -%}
{% call tag(message.role) %}{{ n }} {{ text(message.content) }} {{ nested(message) }}{% endcall %}
{{ many(1, 2, role=message.role) }} {{ text(content=message.content) }}
{%- endfor %}
{{ text(none) }}{{ tag is defined }}{{ many() }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "assistant", "content": "18 C at noon."},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def _render(text: str, environment, messages, tools):
    template = compile_template(text, environment) if environment else compile_template(text)
    try:
        return template.render(
            messages=messages, tools=tools, add_generation_prompt=True, bos_token="<s>"
        )
    except Exception as exc:  # noqa: BLE001 (compared, not handled)
        return (type(exc), str(exc))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_each_template_renders_as_the_plain_sandbox_renders_it(tiny_model_dir, messages, tools):
    tiny = (tiny_model_dir / "chat_template.jinja").read_text()
    for text in (tiny, CHATML_TOOLS, LLAMA, PROBES, MACROS):
        expected = _render(text, ImmutableSandboxedEnvironment, messages, tools)
        assert _render(text, None, messages, tools) == expected


def test_the_sandbox_still_refuses_what_it_refused():
    messages = [{"role": "user", "content": "Hi"}]
    for text in (
        "{{ messages[0].__class__ }}",
        "{{ messages[0].__class__.__mro__ }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{{ messages[0].clear() }}",
        "{{ messages.append(1) }}",
        "{{ messages[0].role.__class__ }}",
        "{{ '{0.__class__}'.format(messages[0]) }}",
        "{% macro m(x) %}{{ x.__class__ }}{% endmacro %}{{ m(messages[0]) }}",
        "{% macro m(x) %}{{ x.update({'role': 'x'}) }}{% endmacro %}{{ m(messages[0]) }}",
        "{% macro m(f) %}{{ f() }}{% endmacro %}{{ m(messages[0].clear) }}",
    ):
        expected = _render(text, ImmutableSandboxedEnvironment, messages, None)
        assert _render(text, None, messages, None) == expected
        assert isinstance(expected, tuple) or expected == "", text  # refused, or undefined
    assert messages == [{"role": "user", "content": "Hi"}]
