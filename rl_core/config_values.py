"""Checking one run setting's value against its ``RunConfig`` field: type, bounds, choices.

``rl_core.config.RunConfig.from_dict`` calls ``coerce`` for each given setting; the messages
say what is wrong and what to set instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def coerce(f: dataclasses.Field, value: Any) -> Any:
    """Check one field's value against its declared type and bounds; raise ValueError with a fix."""
    meta = f.metadata
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    optional = "None" in kind
    if value is None or (optional and value == ""):
        if optional:
            return None
        raise ValueError(f"{f.name} cannot be empty; the default is {f.default!r}.")
    base = kind.replace(" | None", "").strip()
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"{f.name} must be true or false; got {value!r}.")
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ValueError(f"{f.name} must be a whole number; got {value!r}.")
        check_bounds(f.name, value, meta)
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{f.name} must be a number; got {value!r}.")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number.")
        check_bounds(f.name, value, meta)
        return value
    if base == "str":
        if meta.get("ids") and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # an object's id, given as a number
        if not isinstance(value, str):
            raise ValueError(f"{f.name} must be a string; got {type(value).__name__}.")
        choices = meta.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}.")
        return value
    if base == "list":
        if isinstance(value, str):  # "q_proj, v_proj" from a form or a shell
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise ValueError(
                f'{f.name} must be a list of names, e.g. ["q_proj", "v_proj"]; got {value!r}.'
            )
        return [v.strip() for v in value]
    if base == "dict":
        if not isinstance(value, dict):
            raise ValueError(f"{f.name} must be a JSON object; got {type(value).__name__}.")
        return value
    raise ValueError(f"{f.name} has an unsupported type {kind}.")  # pragma: no cover


def check_bounds(name: str, value: float, meta: Any) -> None:
    low, high = meta.get("min"), meta.get("max")
    if low is not None:
        if meta.get("min_exclusive") and value <= low:
            raise ValueError(f"{name} must be greater than {low}; got {value}.")
        if value < low:
            raise ValueError(f"{name} must be at least {low}; got {value}.")
    if high is not None:
        if meta.get("max_exclusive") and value >= high:
            raise ValueError(f"{name} must be less than {high}; got {value}.")
        if value > high:
            raise ValueError(f"{name} must be at most {high}; got {value}.")
