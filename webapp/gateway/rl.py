"""The RL protocol's endpoints (``/rl/start_session``, ``/rl/set_reward``, ``/rl/end_session``),
independent of the web framework.

Each takes the request's parts and returns a ``Reply``, as ``completions.chat_completion``
does: the ASGI fast route calls them with this process's lane (``lane.in_lane``), Django's
views with ``lane.in_thread``. Bad input is refused before the database is touched; the
database work is one operation of ``webapp.gateway.episodes``, committed (durably) before
the answer.
"""

from __future__ import annotations

import math

from webapp.accounts.auth import bearer_token
from webapp.accounts.keys import SESSION_KEY_PREFIX, generate_key
from webapp.gateway import episodes, turns
from webapp.gateway.chat_request import parse_json_body
from webapp.gateway.errors import GatewayError, bad_request
from webapp.gateway.lane import in_lane
from webapp.gateway.replies import Reply

HINT_MAX_CHARS = 8_000  # a correction in words, not a document


async def start_session(
    *, agent_id: str, authorization: str, content_type: str, body: bytes, db=in_lane
) -> Reply:
    """``POST /rl/start_session`` ``{"task_id"?, "metadata"?}`` → 201 ``{"session_id", "api_key"}``."""
    try:
        data = parse_json_body(body, content_type) if body else {}
        if not isinstance(data, dict):
            raise bad_request("The body must be a JSON object (or empty).", code="invalid_json")
        task_id, metadata = data.get("task_id", ""), data.get("metadata") or {}
        if task_id is None:
            task_id = ""
        if not isinstance(task_id, str | int):
            raise bad_request("'task_id' must be a string.", param="task_id", code="invalid_type")
        if not isinstance(metadata, dict):
            raise bad_request(
                "'metadata' must be an object.", param="metadata", code="invalid_type"
            )
        operation = episodes.start(
            token=_token(authorization),
            agent_id=agent_id,
            task_id=str(task_id),
            metadata=metadata,
            new_key=generate_key(SESSION_KEY_PREFIX),
        )
        return Reply.json(await db(operation), status=201)
    except GatewayError as exc:
        return Reply.error(exc)


async def set_reward(
    *, agent_id: str, authorization: str, content_type: str, body: bytes, db=in_lane
) -> Reply:
    """``POST /rl/set_reward`` ``{"reward": number, "interaction_id"?: str, "hint"?: str,
    "role"?: str}`` (``hint``: a correction in words, the teacher's context in a
    self-distilling run; ``role``: without an id, the last turn of that role of a multi-agent run)."""
    try:
        data = parse_json_body(body, content_type)
        if not isinstance(data, dict):
            raise bad_request("The body must be a JSON object with 'reward'.", code="invalid_json")
        reward = data.get("reward")
        if reward is None:
            raise bad_request(
                "'reward' is required (a number).",
                param="reward",
                code="missing_required_parameter",
            )
        if (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            raise bad_request(
                "'reward' must be a finite number.", param="reward", code="invalid_type"
            )
        interaction_id = data.get("interaction_id")
        if interaction_id is not None and not isinstance(interaction_id, str):
            raise bad_request(
                "'interaction_id' must be a string.", param="interaction_id", code="invalid_type"
            )
        hint = data.get("hint")
        if hint is not None and not isinstance(hint, str):
            raise bad_request("'hint' must be a string.", param="hint", code="invalid_type")
        if hint is not None and len(hint) > HINT_MAX_CHARS:
            raise bad_request(
                f"'hint' is {len(hint):,} characters; at most {HINT_MAX_CHARS:,}.",
                param="hint",
                code="string_above_max_length",
            )
        role = data.get("role")
        if role is not None and not isinstance(role, str):
            raise bad_request("'role' must be a string.", param="role", code="invalid_type")
        operation = episodes.reward(
            token=_token(authorization),
            agent_id=agent_id,
            reward=float(reward),
            interaction_id=interaction_id,
            hint=hint,
            role=role,
        )
        return Reply.json(await db(operation))
    except GatewayError as exc:
        return Reply.error(exc)


async def end_session(
    *, agent_id: str, authorization: str, content_type: str, body: bytes, db=in_lane
) -> Reply:
    """``POST /rl/end_session`` (the session key as bearer) → ``{"session_id", "interaction_count", "trajectory"}``."""
    try:
        return Reply.json(await db(episodes.end(token=_token(authorization), agent_id=agent_id)))
    except GatewayError as exc:
        return Reply.error(exc)


def _token(authorization: str) -> str:
    token = bearer_token(authorization)
    if not token:
        raise turns.missing_key()  # before touching the database
    return token
