"""Server-sent events of a ``/generate`` stream (SGLang's and the torch engine's; vLLM's too).

``data: {...}`` lines, ``data: [DONE]`` at the end; an event holding ``error`` (and no
``meta_info``) is the server's error mid-stream, raised as ``InferenceError``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from rl_core.inference.protocol import InferenceError

DONE = object()


def sse_data(line: bytes) -> Any:
    """The JSON of one ``data:`` line; ``DONE`` for ``[DONE]``; None for anything else."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return DONE
    data = orjson.loads(payload)
    if isinstance(data, dict) and "error" in data and "meta_info" not in data:
        raise InferenceError(f"/generate stream error: {data['error']}", body=data)
    return data


def newest_sse_data(lines: list[bytes]) -> Any:
    """The JSON of the last ``data:`` event among ``lines`` (``[DONE]`` aside), or None."""
    for line in reversed(lines):
        data = sse_data(line)
        if data is not None and data is not DONE:
            return data
    return None


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        data = json.loads(payload)
        if "error" in data and "meta_info" not in data:
            raise InferenceError(f"/generate stream error: {data['error']}", body=data)
        yield data
