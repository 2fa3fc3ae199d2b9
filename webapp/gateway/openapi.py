"""The agent gateway in the OpenAPI schema: one ``Endpoint`` per route of ``webapp.gateway.urls``.

The gateway's views are plain async Django views (and the ASGI fast route answers the same
paths), so drf_spectacular cannot introspect them. ``webapp.api.schema.add_agent_gateway``
puts these path items in ``/api/v1/schema/`` first, tagged ``Agent gateway``;
``tests/web/test_openapi_gateway.py`` fails when a route has no entry here or a method differs.
Paths are full (``/agents/{agent_id}/v1/...``) so Swagger UI's *Try it out* reaches them; an agent
sees them under its ``base_url``. The contract in words: ``docs/gateway.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TAG = "Agent gateway"
BASE_URL = "/agents/{agent_id}/v1"
AGENT_KEY = "AgentKey"
ANTHROPIC_KEY = "AnthropicApiKey"

TAG_DESCRIPTION = (
    "What an agent calls: one OpenAI-compatible `base_url` per agent, "
    "`{SITE_URL}/agents/{agent_id}/v1` (the dashboard's agent page and `POST /api/v1/agents/` "
    "show it). The `openai` SDK, the OpenAI Agents SDK, LangChain and curl use it unchanged; the "
    "`anthropic` SDK takes it without `/v1`. An episode: `POST /rl/start_session` → completions "
    "with the session key → `POST /rl/set_reward` → `POST /rl/end_session`. Errors are "
    'OpenAI\'s `{"error": {"message", "type", "param", "code"}}` (Anthropic\'s shape on '
    "`/messages`)."
)

SECURITY_SCHEMES: dict[str, dict] = {
    AGENT_KEY: {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "sk-steep-… or a session key",
        "description": "The project's API key, or the session key `POST /rl/start_session` "
        "returned (one episode). The agent's SDK sends it as `api_key`.",
    },
    ANTHROPIC_KEY: {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "The same keys as the `anthropic` SDK sends them (`/messages` only).",
    },
}

# What each error status means on the gateway; an endpoint lists the ones it can answer.
ERRORS: dict[int, str] = {
    400: "Malformed JSON or a bad field; `error.param` names it and `error.code` says why.",
    401: "No key, or an invalid, revoked, expired or superseded one (`WWW-Authenticate: Bearer`).",
    404: "Unknown agent, also another project's (no existence leak); on `set_reward` an "
    "unknown `interaction_id`; `model_not_found` for `policy/<role>` naming a role the "
    "run does not train.",
    405: "Another HTTP method than the one this endpoint takes.",
    409: "The session has ended (`session_ended`): start a new one; on `set_reward` also a "
    "reward that is final or a session with no completion yet.",
    410: "The session expired after `SESSION_IDLE_TIMEOUT_S` idle (`session_expired`).",
    413: "The body is larger than `MAX_REQUEST_BYTES` (16 MiB by default).",
    429: "The run's staleness budget is full (`staleness_budget_full`: training has to catch "
    "up), the pool's `max_sessions_per_run` is reached, or the key's rate limit "
    "(`RATE_LIMIT_GATEWAY_PER_MIN`). Wait `Retry-After` seconds and retry.",
    502: "The inference server's answer ended before it was complete.",
    503: "The agent has no run, its run is not running (start it), no inference server is up, "
    "or the database is unavailable; retry after `Retry-After` when given.",
}
_RETRY_AFTER = {429, 503}


def _obj(required: tuple[str, ...] = (), **properties: dict) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def _t(kind: str, description: str = "", **extra: Any) -> dict:
    return {"type": kind, **({"description": description} if description else {}), **extra}


_ANY_OBJECT = {"type": "object", "additionalProperties": True}
_STRING_OR_LIST = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

COMPONENTS: dict[str, dict] = {
    "GatewayError": _obj(
        ("error",),
        error=_obj(
            ("message", "type"),
            message=_t("string", "What is wrong and what to do."),
            type=_t(
                "string", "e.g. invalid_request_error, authentication_error, rate_limit_error."
            ),
            param={"type": "string", "nullable": True, "description": "The field at fault."},
            code={"type": "string", "nullable": True, "description": "e.g. session_expired."},
        ),
    ),
    "AnthropicError": _obj(
        ("type", "error"),
        type=_t("string", "Always `error`.", enum=["error"]),
        error=_obj(("type", "message"), type={"type": "string"}, message={"type": "string"}),
    ),
    "ChatMessage": {
        **_obj(
            ("role",),
            role=_t("string", enum=["system", "developer", "user", "assistant", "tool"]),
            content={
                "description": "Text, or a list of `{type: text, text}` parts.",
                "oneOf": [{"type": "string"}, {"type": "array", "items": _ANY_OBJECT}],
                "nullable": True,
            },
            tool_calls={"type": "array", "items": _ANY_OBJECT},
            tool_call_id=_t("string", "On a `tool` message: the call it answers."),
            name={"type": "string"},
        ),
    },
    "ChatCompletionRequest": _obj(
        ("messages",),
        model=_t(
            "string",
            "Any name; the run's policy answers (`GET /models` shows it). A multi-agent run "
            "answers `\"policy/<role>\"` with that role's adapter, else the agent's role.",
        ),
        messages={
            "type": "array",
            "minItems": 1,
            "items": {"$ref": "#/components/schemas/ChatMessage"},
        },
        max_tokens=_t("integer", "Default 512.", minimum=1),
        max_completion_tokens=_t("integer", "Wins over `max_tokens`.", minimum=1),
        temperature=_t("number", "0 to 2, default 1 (0: greedy).", minimum=0, maximum=2),
        top_p=_t("number", "0 to 1, default 1.", minimum=0, maximum=1),
        top_k=_t("integer", "SGLang's and vLLM's extension (the SDK's `extra_body`); -1: off."),
        min_p=_t("number", "Extension, like `top_k`."),
        repetition_penalty=_t("number", "Extension; 1 is none."),
        min_tokens=_t("integer", "Extension: no end of turn before this many tokens."),
        presence_penalty=_t("number", "-2 to 2.", minimum=-2, maximum=2),
        frequency_penalty=_t("number", "-2 to 2.", minimum=-2, maximum=2),
        n=_t("integer", "Choices, 1 to 16.", minimum=1, maximum=16),
        seed={"type": "integer"},
        stop={**_STRING_OR_LIST, "description": "Up to 4 stop strings."},
        stream=_t("boolean", "Server-sent events, token by token, ending `data: [DONE]`."),
        stream_options=_obj(include_usage={"type": "boolean"}),
        logprobs=_t("boolean", "Each token's logprob (of the distribution sampled)."),
        top_logprobs=_t("integer", "0 to 20; needs `logprobs`.", minimum=0, maximum=20),
        tools={
            "type": "array",
            "items": _ANY_OBJECT,
            "description": "`{type: function, function: {name, description?, parameters?}}`.",
        },
        tool_choice={
            "description": "`none`, `auto`, `required` or a named function.",
            "oneOf": [{"type": "string"}, _ANY_OBJECT],
        },
    ),
    "ChatCompletion": {
        **_obj(
            ("id", "object", "choices"),
            id=_t("string", "The interaction id: `POST /rl/set_reward` takes it."),
            object=_t("string", enum=["chat.completion"]),
            created={"type": "integer"},
            model={"type": "string"},
            choices={
                "type": "array",
                "items": _ANY_OBJECT,
                "description": "`{index, message, finish_reason, logprobs, matched_stop}`.",
            },
            usage=_ANY_OBJECT,
        ),
        "additionalProperties": True,
    },
    "ResponseRequest": _obj(
        ("input",),
        model={"type": "string"},
        input={
            "description": "A string, or items: messages with `input_text`/`output_text` parts, `function_call`, `function_call_output`.",
            "oneOf": [{"type": "string"}, {"type": "array", "items": _ANY_OBJECT}],
        },
        instructions=_t("string", "The system message."),
        previous_response_id=_t(
            "string",
            "A turn of the same session (or agent, with the project key); its conversation comes first.",
        ),
        max_output_tokens=_t("integer", minimum=1),
        temperature={"type": "number"},
        top_p={"type": "number"},
        tools={"type": "array", "items": _ANY_OBJECT, "description": "Flat function tools."},
        tool_choice={"oneOf": [{"type": "string"}, _ANY_OBJECT]},
        stream=_t(
            "boolean", "`response.created` … `response.output_text.delta` … `response.completed`."
        ),
    ),
    "Response": {
        **_obj(
            ("id", "object", "output"),
            id=_t("string", "The interaction id: `POST /rl/set_reward` takes it."),
            object=_t("string", enum=["response"]),
            status={"type": "string"},
            model={"type": "string"},
            output={"type": "array", "items": _ANY_OBJECT},
            usage=_ANY_OBJECT,
        ),
        "additionalProperties": True,
    },
    "MessageRequest": _obj(
        ("max_tokens", "messages"),
        model={"type": "string"},
        max_tokens=_t("integer", minimum=1),
        system={"oneOf": [{"type": "string"}, {"type": "array", "items": _ANY_OBJECT}]},
        messages={
            "type": "array",
            "items": _ANY_OBJECT,
            "description": "Text, `tool_use` and `tool_result` blocks.",
        },
        tools={
            "type": "array",
            "items": _ANY_OBJECT,
            "description": "`{name, description?, input_schema}`.",
        },
        tool_choice=_ANY_OBJECT,
        stop_sequences={"type": "array", "items": {"type": "string"}},
        temperature={"type": "number"},
        top_p={"type": "number"},
        top_k={"type": "integer"},
        stream=_t("boolean", "Anthropic's events (`message_start` … `message_stop`)."),
    ),
    "Message": {
        **_obj(
            ("id", "type", "content"),
            id=_t("string", "The interaction id: `POST /rl/set_reward` takes it."),
            type=_t("string", enum=["message"]),
            role=_t("string", enum=["assistant"]),
            content={"type": "array", "items": _ANY_OBJECT},
            stop_reason=_t("string", enum=["end_turn", "max_tokens", "tool_use", "stop_sequence"]),
            stop_sequence={"type": "string", "nullable": True},
            usage=_ANY_OBJECT,
        ),
        "additionalProperties": True,
    },
    "ModelList": _obj(
        ("object", "data"),
        object=_t("string", enum=["list"]),
        data={
            "type": "array",
            "description": "The agent's run's policy; empty when the agent has no run.",
            "items": _obj(
                id={"type": "string"},
                object={"type": "string"},
                created={"type": "integer"},
                owned_by={"type": "string"},
                root=_t("string", "The run's base_model."),
                weight_version=_t("integer", "The policy version being served."),
                run_id={"type": "string"},
            ),
        },
    ),
    "StartSessionInput": _obj(
        task_id=_t("string", "Yours: shown on the session and in exports."),
        metadata={**_ANY_OBJECT, "description": "Yours, kept with the session."},
    ),
    "StartSessionOutput": _obj(
        ("session_id", "api_key"),
        session_id={"type": "string", "format": "uuid"},
        api_key=_t("string", "The session key: the agent's `api_key` for this episode."),
    ),
    "SetRewardInput": _obj(
        ("reward",),
        reward=_t("number", "A finite number."),
        interaction_id=_t(
            "string",
            "A completion's `id`; absent: the session's last turn. Required with the project key.",
        ),
        hint=_t(
            "string",
            "A correction in words (a self-distilling run's teacher context), up to 8,000 characters.",
            maxLength=8000,
        ),
        role=_t(
            "string",
            "A multi-agent run's role: without `interaction_id`, the session's last turn of "
            "that role is rewarded. One of the run's roles; a 400 otherwise, and on a run "
            "without roles.",
        ),
    ),
    "SetRewardOutput": _obj(
        ("interaction_id", "session_id", "reward"),
        interaction_id={"type": "string"},
        session_id={"type": "string", "format": "uuid"},
        reward={"type": "number"},
        hint={"type": "string"},
    ),
    "EndSessionOutput": _obj(
        ("session_id", "interaction_count", "trajectory"),
        session_id={"type": "string", "format": "uuid"},
        interaction_count={"type": "integer"},
        trajectory=_t(
            "string",
            "`ready`: goes to training; `unrewarded`: never trained.",
            enum=["pending", "ready", "claimed", "trained", "dropped", "unrewarded"],
        ),
    ),
}

_TURN_ERRORS = (400, 401, 404, 405, 409, 410, 413, 429, 502, 503)
_SESSION_ERRORS = (400, 401, 404, 405, 409, 410, 413, 429, 503)


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # under the agent's base_url, as the agent sends it
    summary: str
    description: str
    success: int
    response: str  # a schema in COMPONENTS
    errors: tuple[int, ...]
    request: str | None = None  # a schema in COMPONENTS
    request_required: bool = True
    streams: bool = False  # `stream: true` answers text/event-stream
    anthropic: bool = False  # x-api-key as well, and errors in Anthropic's shape


_RETRY_HEADERS = ("Idempotency-Key", "X-Stainless-Retry-Count")

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "post", "/rl/start_session", "Start a session (one episode)",
        "Admits an episode for the agent's run (429 while the staleness budget is full) and "
        "answers a session key: the agent uses it as its `api_key` until `/rl/end_session`. "
        "Called with a live session key it ends that session and binds the same key to a new one.",
        201, "StartSessionOutput", _SESSION_ERRORS, "StartSessionInput", request_required=False,
    ),
    Endpoint(
        "post", "/chat/completions", "Chat completion (OpenAI)",
        "One turn of the session (or, with the project key, a one-turn episode). The response "
        "`id` is the interaction id. Recorded token-exact before the answer goes out. A re-sent "
        "request (`Idempotency-Key`, `X-Stainless-Retry-Count`) gets the first answer back.",
        200, "ChatCompletion", _TURN_ERRORS, "ChatCompletionRequest", streams=True,
    ),
    Endpoint(
        "post", "/responses", "Create a response (OpenAI Responses API)",
        "The Responses API (Codex-style agents, the OpenAI Agents SDK) as a chat turn: the same "
        "auth, admission, record and streaming as `/chat/completions`. The response `id` is the "
        "interaction id.",
        200, "Response", _TURN_ERRORS, "ResponseRequest", streams=True,
    ),
    Endpoint(
        "post", "/messages", "Create a message (Anthropic Messages API)",
        "Anthropic's Messages API as a chat turn. The `anthropic` SDK appends `/v1/messages` "
        "itself: give it the agent's URL without `/v1`. The key goes in `x-api-key` or "
        '`Authorization: Bearer`. Errors keep their status in Anthropic\'s shape `{"type": '
        '"error", "error": {"type", "message"}}`.',
        200, "Message", _TURN_ERRORS, "MessageRequest", streams=True, anthropic=True,
    ),
    Endpoint(
        "get", "/models", "The run's policy model",
        "The model the agent's run serves, with its current weight version; a multi-agent "
        "run also lists `policy` and `policy/<role>` for each of its roles.",
        200, "ModelList", (401, 404, 405, 429, 503),
    ),
    Endpoint(
        "post", "/rl/set_reward", "Reward a turn",
        "A reward for one turn: the one named by `interaction_id`, else the session's last "
        "(of `role`, when given, in a multi-agent run). "
        "Per-turn rewards are kept; later rewards are credited to earlier turns with the run's "
        "`turn_discount`. With the project key, `interaction_id` names a one-turn completion, "
        "which then goes to training. Setting the same value again changes nothing.",
        200, "SetRewardOutput", _SESSION_ERRORS, "SetRewardInput",
    ),
    Endpoint(
        "post", "/rl/end_session", "End the session",
        "With the session key as bearer: the session's trajectory (every turn, token-exact) is "
        "complete and, rewarded, goes to the trainer. No body.",
        200, "EndSessionOutput", (400, 401, 404, 405, 409, 410, 413, 429, 503),
    ),
)  # fmt: skip


# What Swagger UI's "Try it out" fills in (and what the tests send).
EXAMPLES: dict[str, dict] = {
    "ChatCompletionRequest": {
        "model": "policy",
        "messages": [{"role": "user", "content": "Say v."}],
        "max_tokens": 8,
    },
    "ResponseRequest": {"model": "policy", "input": "Say v.", "max_output_tokens": 8},
    "MessageRequest": {
        "model": "policy",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say v."}],
    },
    "StartSessionInput": {"task_id": "task-1", "metadata": {"split": "train"}},
    "SetRewardInput": {"reward": 1.0},
}
for _name, _example in EXAMPLES.items():
    COMPONENTS[_name]["example"] = _example


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _operation(endpoint: Endpoint) -> dict:
    error_schema = _ref("AnthropicError" if endpoint.anthropic else "GatewayError")
    success_content: dict[str, dict] = {"application/json": {"schema": _ref(endpoint.response)}}
    if endpoint.streams:
        success_content["text/event-stream"] = {
            "schema": {"type": "string", "description": "With `stream: true`: server-sent events."}
        }
    responses: dict[str, dict] = {
        str(endpoint.success): {"description": endpoint.summary, "content": success_content}
    }
    for status in endpoint.errors:
        response: dict[str, Any] = {
            "description": ERRORS[status],
            "content": {"application/json": {"schema": error_schema}},
        }
        if status in _RETRY_AFTER:
            response["headers"] = {
                "Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}
            }
        responses[str(status)] = response
    parameters: list[dict] = [
        {
            "name": "agent_id",
            "in": "path",
            "required": True,
            "schema": {"type": "string", "format": "uuid"},
            "description": "The agent (its `base_url` ends `/agents/{agent_id}/v1`).",
        }
    ]
    if endpoint.request in ("ChatCompletionRequest", "ResponseRequest", "MessageRequest"):
        parameters += [
            {
                "name": header,
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "An SDK's retry: the first attempt's answer comes back, recorded once.",
            }
            for header in _RETRY_HEADERS
        ]
    security: list[dict[str, list[str]]] = [{AGENT_KEY: []}]
    if endpoint.anthropic:
        security = [{ANTHROPIC_KEY: []}, {AGENT_KEY: []}]
    operation: dict[str, Any] = {
        "operationId": "gateway_" + endpoint.path.strip("/").replace("/", "_"),
        "summary": endpoint.summary,
        "description": f"`{endpoint.method.upper()} {{base_url}}{endpoint.path}`. "
        + endpoint.description,
        "tags": [TAG],
        "security": security,
        "parameters": parameters,
        "responses": responses,
    }
    if endpoint.request is not None:
        operation["requestBody"] = {
            "required": endpoint.request_required,
            "content": {"application/json": {"schema": _ref(endpoint.request)}},
        }
    return operation


def path_items() -> dict[str, dict]:
    """``{"/agents/{agent_id}/v1/<path>": {method: operation}}`` in ``ENDPOINTS``' order."""
    items: dict[str, dict] = {}
    for endpoint in ENDPOINTS:
        items.setdefault(BASE_URL + endpoint.path, {})[endpoint.method] = _operation(endpoint)
    return items
