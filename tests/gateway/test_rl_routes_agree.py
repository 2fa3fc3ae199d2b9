"""The RL protocol's two routes give the same answers: the ASGI fast route (the live server,
the lane's group commit) and Django's views (in this process, ``lane.in_thread``) run the
same sequence of calls, and their status codes, JSON answers and recorded rows are equal."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client

from webapp.gateway.models import Interaction, Session
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "Hi"}]
IDS = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|chatcmpl-[0-9a-f]+|sk-[\w-]+"
)


class Route:
    """Calls to one agent's base_url through one route; ``key`` names the bearer to send."""

    def __init__(self, gw, fast: bool):
        self.gw, self.fast = gw, fast
        self.keys: dict[str, str | None] = {"project": gw.key, "none": None, "bogus": "sk-nope"}
        self.django = Client()

    def post(
        self, path: str, body: Any = None, *, key: str = "project", agent=None
    ) -> tuple[int, Any]:
        content = b"" if body is None else json.dumps(body).encode()
        bearer = self.keys[key]
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        agent_id = agent or self.gw.agent.id
        if self.fast:
            response = self.gw.http.post(
                f"{self.gw.server}/agents/{agent_id}/v1{path}",
                content=content,
                headers={**headers, "Content-Type": "application/json"},
            )
            return response.status_code, response.json()
        response = self.django.post(
            f"/agents/{agent_id}/v1{path}",
            data=content,
            content_type="application/json",
            headers=headers,
        )
        return response.status_code, json.loads(response.content)


def play(route: Route) -> list[tuple[str, int, Any]]:
    """One agent's episode protocol, the well-behaved and the wrong calls; every answer."""
    answers = []

    def call(name: str, path: str, body: Any = None, **kwargs) -> Any:
        status, answer = route.post(path, body, **kwargs)
        # A completion's text and timestamps are the model's and the clock's: keep its id.
        sampled = path == "/chat/completions" and status == 200
        answers.append((name, status, {"id": answer["id"]} if sampled else answer))
        return answer

    started = call("start", "/rl/start_session", {"task_id": "t1", "metadata": {"k": 1}})
    route.keys["session"] = started.get("api_key")
    call("start, metadata not an object", "/rl/start_session", {"metadata": [1]})
    call("start, body not an object", "/rl/start_session", [1])
    call("reward before any turn", "/rl/set_reward", {"reward": 1.0}, key="session")
    call("turn", "/chat/completions", {"messages": HI, "max_tokens": 2}, key="session")
    call("reward", "/rl/set_reward", {"reward": 0.5}, key="session")
    call("same reward again", "/rl/set_reward", {"reward": 0.5}, key="session")
    call("reward, not a number", "/rl/set_reward", {"reward": "high"}, key="session")
    call(
        "reward, unknown turn",
        "/rl/set_reward",
        {"reward": 1, "interaction_id": "x"},
        key="session",
    )
    call("rebind the key to a new session", "/rl/start_session", {}, key="session")
    call("end", "/rl/end_session", key="session")
    call("end again", "/rl/end_session", key="session")
    call("reward after the end", "/rl/set_reward", {"reward": 2.0}, key="session")
    call("start with an ended key", "/rl/start_session", key="session")
    call("end with the project key", "/rl/end_session")
    call("reward with the project key, no id", "/rl/set_reward", {"reward": 1.0})
    one_turn = call("one-turn completion", "/chat/completions", {"messages": HI, "max_tokens": 2})
    reward = {"reward": 1.0, "interaction_id": one_turn.get("id")}
    call("reward a one-turn completion", "/rl/set_reward", reward)
    call("change it before training", "/rl/set_reward", reward | {"reward": 0.0})
    call("no key", "/rl/start_session", key="none")
    call("a bogus key", "/rl/end_session", key="bogus")
    call("another agent", "/rl/start_session", agent="00000000-0000-0000-0000-000000000000")
    return answers


def normalised(value: Any, names: dict[str, str]) -> Any:
    """``value`` with every id and key replaced by its order of first appearance."""
    text = json.dumps(value, sort_keys=True)
    for found in IDS.findall(text):
        names.setdefault(found, f"<id{len(names)}>")
    return json.loads(IDS.sub(lambda m: names[m.group(0)], text))


def recorded(run: Run, names: dict[str, str]) -> Any:
    run.refresh_from_db()
    sessions = Session.objects.filter(run=run).order_by("created_at")
    rows = [
        {
            "id": str(s.id),
            "status": s.status,
            "trajectory": s.trajectory,
            "one_turn": s.one_turn,
            "has_key": s.key_hash is not None,
            "task_id": s.task_id,
            "metadata": s.metadata,
            "interaction_count": s.interaction_count,
            "turns": [
                {"turn": i.turn, "reward": i.reward, "rewarded": i.rewarded_at is not None}
                for i in Interaction.objects.filter(session=s).order_by("turn")
            ],
        }
        for s in sessions
    ]
    counters = {"open": run.sessions_open, "accepted": run.sessions_accepted}
    return normalised({"sessions": rows, "counters": counters}, names)


def test_both_routes_give_the_same_answers_and_rows(
    make_gateway, project, api_key, server_env, settings
):
    for name, value in server_env.items():
        setattr(settings, name, int(value))
    outcomes = []
    for fast in (True, False):
        gw = make_gateway(project, api_key, name=f"agent-{'fast' if fast else 'django'}")
        names: dict[str, str] = {}
        answers = [
            (name, status, normalised(answer, names))
            for name, status, answer in play(Route(gw, fast))
        ]
        outcomes.append({"answers": answers, "rows": recorded(gw.run, names)})

    fast, django = outcomes
    for (name, status, answer), other in zip(fast["answers"], django["answers"], strict=True):
        assert (name, status, answer) == other, name
    assert fast["rows"] == django["rows"]
    # The sequence exercised what it means to: a refusal of each kind, two sessions, a one-turn one.
    statuses = {status for _, status, _ in fast["answers"]}
    assert statuses == {200, 201, 400, 401, 404, 409}
    assert len(fast["rows"]["sessions"]) == 3
