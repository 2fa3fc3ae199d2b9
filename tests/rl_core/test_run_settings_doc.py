"""docs/run-settings.md is the reference of every run setting: generated from RunConfig, kept in step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rl_core.config import RunConfig
from rl_core.settings_doc import settings_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "run-settings.md"


def test_the_doc_is_what_runconfig_generates():
    assert DOC.read_text() == settings_markdown(), (
        "docs/run-settings.md is out of date: run `python -m rl_core.settings_doc > docs/run-settings.md`"
    )


def test_every_setting_has_a_row_with_its_default_and_bounds():
    text = settings_markdown()
    for f in dataclasses.fields(RunConfig):
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{f.name}` |")]
        assert f.metadata["help"] in row
    assert "| `lora_dropout` | number | `0.0` | ≥ 0.0, < 1.0 |" in text
    assert "| `base_model` | string | required |" in text
    assert "| `eps_clip_higher` | number or null | `null` |" in text
