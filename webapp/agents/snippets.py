"""The copy-paste snippet an agent author needs: swap base_url and api_key, keep the code."""

from __future__ import annotations


def openai_snippet(*, base_url: str, api_key: str = "sk-steep-...", model: str = "policy") -> str:
    """One episode: start a session, point the OpenAI client at it, set a reward, end it."""
    return f'''import httpx
from openai import OpenAI

BASE_URL = "{base_url}"
PROJECT_KEY = "{api_key}"  # a project API key

# One episode = one session. Its key ties every completion to the session's trajectory.
started = httpx.post(
    f"{{BASE_URL}}/rl/start_session",
    headers={{"Authorization": f"Bearer {{PROJECT_KEY}}"}},
    json={{"task_id": "arith-1", "metadata": {{"split": "train"}}}},
)
started.raise_for_status()
session_key = started.json()["api_key"]

client = OpenAI(base_url=BASE_URL, api_key=session_key)  # your agent code, unchanged
reply = client.chat.completions.create(
    model="{model}",
    messages=[{{"role": "user", "content": "What is 2 + 2?"}}],
)
answer = reply.choices[0].message.content or ""

session = {{"Authorization": f"Bearer {{session_key}}"}}
reward = 1.0 if "4" in answer else 0.0
httpx.post(f"{{BASE_URL}}/rl/set_reward", headers=session, json={{"reward": reward}}).raise_for_status()
httpx.post(f"{{BASE_URL}}/rl/end_session", headers=session).raise_for_status()  # off to training'''
