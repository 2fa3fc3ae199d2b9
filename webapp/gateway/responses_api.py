"""OpenAI's Responses API: ``POST /agents/{agent_id}/v1/responses``, a translation onto chat turns.

The request becomes a chat-completions body (``input`` items → messages, flat function
tools → chat tools, ``max_output_tokens`` → ``max_tokens``) and runs as one chat turn
(``chat_events.chat_turn``), so it is recorded exactly like a chat turn and the response
``id`` is the interaction id (for ``/rl/set_reward``). The answer is rendered as a
Response object, or streamed as Responses events (``responses_render``).

``previous_response_id``: the conversation of that turn (its messages and its answer)
comes before ``input``. With a session key it must be a turn of the same session, with a
project key a turn of the same agent; anything else is "not found" (404, no existence
leak). Unlike OpenAI, the previous conversation keeps its system message: ``instructions``
given again replace it, and absent they are carried over, so an agent that sends its
instructions only once keeps them, and one that sends them every time extends the
previous turn's exact tokens.
"""

from __future__ import annotations

from typing import Any

from webapp.accounts.auth import bearer_token
from webapp.agents.models import Agent
from webapp.gateway import earlier_turns, sql, turns
from webapp.gateway.chat_events import chat_turn, final_completion
from webapp.gateway.chat_request import parse_json_body
from webapp.gateway.errors import GatewayError, bad_request
from webapp.gateway.lane import in_lane
from webapp.gateway.models import Interaction, Session
from webapp.gateway.replies import Reply
from webapp.gateway.responses_render import render_response, response_stream

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


async def create_response(
    *,
    agent_id: str,
    authorization: str,
    content_type: str,
    body: bytes,
    retry_count: str = "",
    idempotency_key: str = "",
    db=in_lane,
) -> Reply:
    """``POST /agents/{agent_id}/v1/responses``; every failure is a Reply in OpenAI's error shape."""
    try:
        request = parse_json_body(body, content_type)
        if not isinstance(request, dict):
            raise bad_request("The request body must be a JSON object.", code="invalid_json")
        chat_body = _chat_body(request, _messages(request))
        previous_id = request.get("previous_response_id")
        if previous_id is not None:  # checked after the rest: bad input never reaches the database
            if not isinstance(previous_id, str):
                raise bad_request(
                    "'previous_response_id' must be a string.",
                    param="previous_response_id",
                    code="invalid_type",
                )
            earlier = await db(
                previous_conversation(
                    token=bearer_token(authorization), agent_id=agent_id, response_id=previous_id
                ),
                durable=False,
            )
            chat_body["messages"] = _after(
                earlier, chat_body["messages"], has_instructions="instructions" in request
            )
        turn = await chat_turn(
            agent_id=agent_id,
            authorization=authorization,
            chat_body=chat_body,
            retry_count=retry_count,
            idempotency_key=idempotency_key,
            db=db,
        )
        if turn.refusal is not None:
            return turn.refusal
        if request.get("stream"):
            return Reply.sse(response_stream(request, turn.events))
        return Reply.json(render_response(request, await final_completion(turn.events)))
    except GatewayError as exc:
        return Reply.error(exc)


def previous_conversation(*, token: str | None, agent_id: str, response_id: str):
    """The lane operation reading the messages of turn ``response_id`` and its answer."""

    def operation(cursor) -> list[dict]:
        caller = turns.authenticate(cursor, token=token, agent_id=agent_id)
        statement = (
            f"SELECT i.messages, i.response, i.chosen, i.prefix_turn, i.session_id, i.turn"
            f" FROM {Interaction._meta.db_table} i"
            f" JOIN {Session._meta.db_table} s ON s.id = i.session_id"
            " WHERE i.id = %s AND s.agent_id = %s"
        )
        params = [response_id, sql.pk(cursor, Agent, caller.agent_id)]
        if caller.session_id is not None:
            statement += " AND s.id = %s"
            params.append(sql.pk(cursor, Session, caller.session_id))
        cursor.execute(statement, params)
        row = cursor.fetchone()
        if row is None:
            raise GatewayError(
                404,
                f"Previous response with id '{response_id}' not found.",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        response, messages = sql.loads(row[1]), sql.loads(row[0])
        if row[3] is not None:  # stored as what it added: read whole (webapp.gateway.deltas)
            whole = earlier_turns.whole_turn(cursor, row[4], int(row[5]))
            messages = whole.messages if whole is not None else messages
        return [*messages, response["choices"][int(row[2] or 0)]["message"]]

    return operation


def _after(earlier: list[dict], messages: list[dict], *, has_instructions: bool) -> list[dict]:
    """``messages`` continuing ``earlier``: this request's instructions (its leading system
    message) replace the earlier ones."""
    if has_instructions and messages and messages[0]["role"] == "system":
        if earlier and earlier[0]["role"] == "system":
            earlier = earlier[1:]
        return [messages[0], *earlier, *messages[1:]]
    return [*earlier, *messages]


def _chat_body(request: dict, messages: list[dict]) -> dict:
    if "model" in request and not isinstance(request["model"], str):
        raise bad_request("'model' must be a string.", param="model", code="invalid_type")
    body: dict[str, Any] = {"model": request.get("model") or "", "messages": messages}
    for name in ("temperature", "top_p", "stream"):
        if request.get(name) is not None:
            body[name] = request[name]
    max_tokens = request.get("max_output_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise bad_request(
                "'max_output_tokens' must be an integer.",
                param="max_output_tokens",
                code="invalid_type",
            )
        if max_tokens < 1:
            raise bad_request("'max_output_tokens' must be at least 1.", param="max_output_tokens")
        body["max_tokens"] = max_tokens
    tools = _tools(request.get("tools"))
    if tools:
        body["tools"] = tools
        body["tool_choice"] = _tool_choice(request.get("tool_choice", "auto"))
    return body


def _messages(request: dict) -> list[dict]:
    """``instructions`` and ``input`` as chat messages."""
    messages: list[dict] = []
    instructions = request.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request(
                "'instructions' must be a string.", param="instructions", code="invalid_type"
            )
        messages.append({"role": "system", "content": instructions})
    items = request.get("input")
    if items is None:
        raise bad_request(
            "'input' is required: a string or a list of input items.",
            param="input",
            code="missing_required_parameter",
        )
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request(
            "'input' must be a string or a non-empty list of input items.",
            param="input",
            code="invalid_type",
        )
    joinable = False  # the last message is an answer that a function_call item continues
    for index, item in enumerate(items):
        joinable = _add_item(messages, item, f"input[{index}]", joinable)
    return messages


def _add_item(messages: list[dict], item: Any, param: str, joinable: bool) -> bool:
    """Append ``item`` to ``messages`` as chat messages; True when it was (part of) an answer."""
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an object.", param=param, code="invalid_type")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        role = _ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise bad_request(
                f"{param}.role must be one of user, assistant, system, developer.",
                param=f"{param}.role",
            )
        messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        return role == "assistant"
    elif kind == "function_call":
        call = {
            "id": _string(item, "call_id", param),
            "type": "function",
            "function": {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param),
            },
        }
        # One chat answer (text and its calls) comes back as several items: join them again,
        # so the conversation matches the turn that produced them token for token.
        if joinable:
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return True
    elif kind == "function_call_output":
        messages.append(
            {
                "role": "tool",
                "tool_call_id": _string(item, "call_id", param),
                "content": _text(item.get("output"), f"{param}.output"),
            }
        )
        return False
    raise bad_request(
        f"{param}.type '{kind}' is not supported: use message, function_call or function_call_output.",
        param=f"{param}.type",
    )


def _string(item: dict, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(
            f"{param}.{name} must be a string.", param=f"{param}.{name}", code="invalid_type"
        )
    return value


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{param} must be a string or a list of content parts.",
            param=param,
            code="invalid_type",
        )
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise bad_request(
                f"{param}: only input_text and output_text parts are supported.", param=param
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(
                f"{param}: a text part needs a string 'text'.", param=param, code="invalid_type"
            )
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools: Any) -> list[dict]:
    """Responses' flat function tools as chat tools (``{type, function: {...}}``)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", param="tools", code="invalid_type")
    chat_tools = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f"{param}: only function tools are supported ({{type: 'function', name, parameters}}).",
                param=param,
            )
        function = {"name": _string(tool, "name", param)}
        for name in ("description", "parameters"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    raise bad_request(
        "'tool_choice' must be 'auto', 'none', 'required' or {type: 'function', name}.",
        param="tool_choice",
    )
