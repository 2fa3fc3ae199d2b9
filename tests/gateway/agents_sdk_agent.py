"""An OpenAI Agents SDK agent with one function tool, run against Steep's gateway: run by
``tests/gateway/test_agents_sdk.py`` with the SDK's own environment (``.venv-agents``,
``./steep install --agents``), as ``python agents_sdk_agent.py BASE_URL KEY MODEL MAX_TURNS``.

Prints one JSON line: the arguments each tool call ran with, the final output (None when the
run stopped at ``MAX_TURNS``) and how it ended.
"""

from __future__ import annotations

import asyncio
import json
import sys

from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

WEATHER = '{"temperature_c": 18, "sky": "clear"}'  # the tool's answer (test_tool_calls.TOOL_RESULT)


async def main(base_url: str, key: str, model: str, max_turns: int) -> dict:
    set_tracing_disabled(True)  # no trace export: nothing leaves 127.0.0.1
    calls: list[dict] = []

    async def get_weather(context, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return WEATHER

    agent = Agent(
        name="weather",
        model=OpenAIChatCompletionsModel(model, AsyncOpenAI(base_url=base_url, api_key=key)),
        model_settings=ModelSettings(temperature=0, max_tokens=120),
        tools=[
            FunctionTool(
                name="get_weather",
                description="Current weather in a city.",
                params_json_schema={
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
                on_invoke_tool=get_weather,
                strict_json_schema=False,
            )
        ],
    )
    try:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=max_turns)
    except MaxTurnsExceeded:
        return {"calls": calls, "final_output": None, "ended": "max_turns"}
    return {"calls": calls, "final_output": result.final_output, "ended": "final_output"}


if __name__ == "__main__":
    base, key, model, turns = sys.argv[1:5]
    print(json.dumps(asyncio.run(main(base, key, model, int(turns)))))
