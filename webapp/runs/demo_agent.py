"""The built-in demo agent: keeps the demo's online run training, as any agent would.

Each ``runs.demo_agent`` beat tick plays episodes of the toy task (``rl_core.toy``) for up
to ``budget_s`` seconds while the online demo run is running, through the gateway with the
official ``openai`` SDK: ``/rl/start_session`` with the demo agent's project key → one chat
turn with the session key → ``/rl/set_reward`` from a self-check
(``say_letter_reward_fn``) → ``/rl/end_session``. Its sessions sit beside the walkthrough's
on the run's page, and the run's charts move.

One player at a time: a tick that finds another still playing (a file lock in DATA_DIR,
released if its process dies) returns at once, so ticks never pile up. It stops with the
worker; ``STEEP_DEMO_AGENT=false`` turns it off. It reaches the gateway at
``INTERNAL_API_URL`` (``SITE_URL`` unless set), the same route agents take, so it also
works where the worker cannot reach the public host name.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings

from rl_core.toy import say_letter_reward_fn, toy_rows
from webapp.runs.demo import demo_agent_credentials

logger = logging.getLogger(__name__)

MAX_TOKENS = 8  # the toy task's answer length (TOY_SETTINGS["max_new_tokens"])


@contextlib.contextmanager
def _one_player(path: Path) -> Iterator[bool]:
    """Whether this process holds the demo agent's lock (non-blocking)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def demo_agent_play(*, budget_s: float = 10.0, pause_s: float = 0.5) -> dict:
    """Play episodes for up to ``budget_s`` seconds, ``pause_s`` apart; a summary of the tick."""
    if not settings.STEEP_DEMO_AGENT:
        return {"played": 0, "idle": "STEEP_DEMO_AGENT is off"}
    with _one_player(Path(settings.DATA_DIR) / "demo-agent.lock") as mine:
        if not mine:
            return {"played": 0, "idle": "another tick is playing"}
        credentials = demo_agent_credentials()
        if credentials is None:
            return {"played": 0, "idle": "no running online demo run"}
        return _play(*credentials, budget_s=budget_s, pause_s=pause_s)


def _play(gateway_url: str, project_key: str, *, budget_s: float, pause_s: float) -> dict:
    import openai  # the SDK any agent uses; imported here, off the web process's start-up

    client = openai.OpenAI(base_url=gateway_url, api_key=project_key, max_retries=0, timeout=30)
    rng = random.Random()
    deadline = time.monotonic() + budget_s
    played, rewards = 0, []
    try:
        while time.monotonic() < deadline:
            row = toy_rows(1, seed=rng.randrange(2**31))[0]
            rewards.append(_episode(client, row))
            played += 1
            time.sleep(pause_s)
    except openai.RateLimitError as exc:  # the staleness budget is full: wait for the next tick
        logger.info("demo agent: backing off (%s)", exc.message)
    except openai.APIError as exc:  # the run stopped meanwhile, the web app restarts, ...
        logger.info("demo agent: stopping this tick: %s", exc)
    finally:
        client.close()
    mean = sum(rewards) / len(rewards) if rewards else None
    return {"played": played, "mean_reward": mean}


def _episode(client, row: dict) -> float:
    """One session: a question, the policy's answer, a self-checked reward."""
    started = client.post(
        "/rl/start_session",
        cast_to=object,
        body={"task_id": "say-the-letter", "metadata": {"agent": "built-in demo agent"}},
    )
    session = client.with_options(api_key=started["api_key"])
    try:
        reply = session.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": row["prompt"]}],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
        )
        answer = reply.choices[0].message.content or ""
        reward = say_letter_reward_fn(row["prompt"], answer, row["answer"])
        session.post("/rl/set_reward", cast_to=object, body={"reward": reward})
    except BaseException:
        # End it anyway: an open session holds a slot of the run's staleness budget until it
        # expires. Ended without a reward, it is simply not trained.
        with contextlib.suppress(Exception):
            session.post("/rl/end_session", cast_to=object, body={})
        raise
    session.post("/rl/end_session", cast_to=object, body={})
    return reward
