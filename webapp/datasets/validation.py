"""Line-by-line validation of dataset JSONL. Pure functions, no I/O beyond the stream given."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

MAX_REPORTED_ERRORS = 20
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}


@dataclass
class ValidationReport:
    rows: int = 0
    bad_lines: int = 0
    errors: list[dict] = field(default_factory=list)

    def add_error(self, line: int, message: str) -> None:
        self.bad_lines += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append({"line": line, "message": message})


def row_error(row) -> str | None:
    """Why one parsed row is not a valid dataset row, or None."""
    if not isinstance(row, dict):
        return "each line must be a JSON object"
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if has_prompt == has_messages:
        return 'each row needs exactly one of "prompt" (a string) or "messages" (a list of chat messages)'
    if has_prompt and (not isinstance(row["prompt"], str) or not row["prompt"]):
        return '"prompt" must be a non-empty string'
    if has_messages:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            return '"messages" must be a non-empty list'
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                return f"messages[{i}] must be an object with role and content"
            if message.get("role") not in CHAT_ROLES:
                return f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}"
            if not isinstance(message.get("content"), str | list):
                return f"messages[{i}].content must be a string or a list of content parts"
    if "answer" in row and not isinstance(row["answer"], str | int | float):
        return '"answer" must be a string or a number'
    if "metadata" in row and not isinstance(row["metadata"], dict):
        return '"metadata" must be an object'
    extra = sorted(set(row) - {"prompt", "messages", "answer", "metadata"})
    if extra:
        return f"unknown keys {', '.join(extra)}; allowed: prompt, messages, answer, metadata"
    return None


def validate_lines(lines: Iterable[bytes], report: ValidationReport) -> Iterator[dict]:
    """Yield each valid row (normalised); record errors with 1-based line numbers in ``report``."""
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            row = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            report.add_error(number, f"not valid JSON ({exc})")
            continue
        problem = row_error(row)
        if problem:
            report.add_error(number, problem)
            continue
        report.rows += 1
        yield row
