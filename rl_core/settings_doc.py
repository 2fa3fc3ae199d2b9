"""docs/run-settings.md: the reference of every run setting, generated from ``RunConfig``.

python -m rl_core.settings_doc > docs/run-settings.md
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from rl_core.config import RunConfig, _default
from rl_core.config_groups import SETTING_GROUPS
from rl_core.reward_specs import REWARD_TYPES_DOC


def settings_markdown() -> str:
    """The reference of every run setting (docs/run-settings.md is this, kept in step by a test)."""
    lines = [
        "# Run settings",
        "",
        "Every setting of a training run: a top-level field of `POST /api/v1/runs/`, a field of",
        "the dashboard's run form, and of `rl_core.config.RunConfig`, which validates them for",
        "both. The groups are the form's: the essentials are open, the others folded under",
        "*Advanced* (`rl_core.config_groups`). Generated from `RunConfig` by",
        "`python -m rl_core.settings_doc`; do not edit by hand.",
    ]
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    for group, names in SETTING_GROUPS.items():
        lines += ["", f"## {group}", "", "| setting | type | default | allowed | meaning |"]
        lines.append("|---|---|---|---|---|")
        lines += [_row(fields[name]) for name in names]
    return "\n".join(lines) + "\n" + REWARD_TYPES_DOC


def _row(f: dataclasses.Field) -> str:
    meta = f.metadata
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    shown = "required" if meta.get("required") else f"`{_json(_default(f))}`"
    json_type = _JSON_TYPES[kind.replace(" | None", "")] + (" or null" if "None" in kind else "")
    return f"| `{f.name}` | {json_type} | {shown} | {_allowed(meta)} | {meta['help']} |"


_JSON_TYPES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "dict": "object",
    "list": "array of strings",
}


def _json(value: Any) -> str:
    return json.dumps(value)


def _allowed(meta: Mapping[str, Any]) -> str:
    if meta.get("choices"):
        return ", ".join(f"`{c}`" for c in meta["choices"])
    low, high = meta.get("min"), meta.get("max")
    parts = []
    if low is not None:
        parts.append(f"{'>' if meta.get('min_exclusive') else '≥'} {low}")
    if high is not None:
        parts.append(f"{'<' if meta.get('max_exclusive') else '≤'} {high}")
    return ", ".join(parts)


if __name__ == "__main__":
    print(settings_markdown(), end="")
