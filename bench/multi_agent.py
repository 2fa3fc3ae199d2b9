"""A two-role run through the gateway: the speaker/listener game learns, role by role.

    .venv/bin/python bench/multi_agent.py [--steps 40] [--episodes 8] [--json out.json]
        [--shared] [--warm-steps 300 | --base-model DIR] [--lr 2e-2] [--phrasings 1]
        [--listener-reward target|heard] [--group-by none|prompt] [--speaker-tokens 8] [--every 1]
    .venv/bin/python bench/multi_agent.py --render out.json [--every 10]

Starts a private Steep (fresh DATA_DIR and SQLite database under .steep/bench/, uvicorn, a
Celery worker with beat, a local Ray head), creates an online run with ``roles`` speaker and
listener (a LoRA adapter each on the tiny model) and two agents, one bound to each role, then
plays the game of ``rl_core.toy`` (``speaker_prompt``, ``listener_prompt``) with the official
``openai`` SDK, ``--episodes`` at a time, until the run completes: the speaker agent's session
sees the target letter and answers one word; the listener agent's session sees only that word
and names a letter; both sessions are rewarded with the listener's score and ended.

Per policy version (the ``system_fingerprint`` of the listener's reply): episodes, success
rate (``listener_named``), mean score; and the run's per-role metrics
(``roles/<role>/reward``). ``--shared`` runs the same game on a one-policy run (no roles:
both agents train one adapter) after it, as the comparison. ``--warm-steps`` first teaches the
tiny model to say a letter a prompt asks for (the demo task), so the players start able to
name letters and the game is about agreeing on which; ``--base-model`` plays with a model
directory of your own. ``--phrasings N`` words the speaker's prompt in one of the first N of
``rl_core.toy.SPEAKER_PHRASINGS`` per episode; ``--listener-reward heard`` scores the listener on
naming the letter the word shows (a per-role reward) instead of the target; ``--group-by prompt``
gives the speaker's sessions a ``group_id`` per (phrasing, target), so its advantages compare
episodes of the same prompt; the run's ``batch_size`` is two sessions per ``--episodes``.
Everything it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.livestack import bench_instance  # noqa: E402

SETTINGS = {
    "mode": "online",
    "batch_size": 16,  # sessions: two per episode (the run's is 2 x --episodes)
    "max_staleness": 2,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "learning_rate": 2e-2,
    "temperature": 1.0,
    "save_every": 1000,
}
MAX_TOKENS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--episodes", type=int, default=8, help="episodes played at once")
    parser.add_argument("--shared", action="store_true", help="also a one-policy run")
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="first train the tiny model this many RL steps on the demo task (say the letter "
        "asked), as bench/distill.py --task demo trains its teacher; 0 = the untrained model",
    )
    parser.add_argument(
        "--base-model", type=Path, help="play with this model directory (copied) instead"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=SETTINGS["learning_rate"],
        help="the runs' learning rate (2e-2 suits the untrained model; a warm one wants less)",
    )
    parser.add_argument(
        "--phrasings",
        type=int,
        default=1,
        help="the speaker's prompt in one of the first N of rl_core.toy.SPEAKER_PHRASINGS, "
        "drawn per episode (1 = the game's own wording only)",
    )
    parser.add_argument(
        "--listener-reward",
        choices=("target", "heard"),
        default="target",
        help="target: both roles get the episode's score; heard: the listener is scored on "
        "naming the letter the speaker's word shows (rl_core.toy.shown_letter), a per-role reward",
    )
    parser.add_argument(
        "--group-by",
        choices=("none", "prompt"),
        default="none",
        help="prompt: the speaker's sessions carry a group_id per (phrasing, target), so its "
        "advantages are against the same prompt's other episodes (GRPO's groups); none: "
        "against the batch",
    )
    parser.add_argument(
        "--speaker-tokens", type=int, default=MAX_TOKENS, help="the speaker's max_tokens"
    )
    parser.add_argument("--every", type=int, default=1, help="a table row per N versions")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--render", type=Path, help="print the tables of a saved --json and exit")
    args = parser.parse_args()
    if args.render:
        for result in json.loads(args.render.read_text()):
            print(table(result, args.every), end="\n\n")
        return
    from rl_core.tiny import build_tiny_model

    results = []
    with bench_instance("multi-agent") as instance:
        rest, key, data_dir = instance.rest(), instance.key, instance.data_dir
        model = build_tiny_model(data_dir / "models" / "tiny-chat")
        if args.base_model:
            model = Path(shutil.copytree(args.base_model, data_dir / "models" / "game-base"))
        elif args.warm_steps:
            model = warm_up(model, data_dir / "models" / "tiny-demo", args.warm_steps)
        kinds = ["roles", "shared"] if args.shared else ["roles"]
        for kind in kinds:
            results.append(asyncio.run(measure(rest, key, model, kind, args)))
    for result in results:
        print(table(result, args.every), end="\n\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def warm_up(model: Path, out: Path, steps: int) -> Path:
    """``model`` after ``steps`` RL steps on the demo task (it learns to say the letter a
    prompt asks for), saved to ``out``: a player that can already name a letter."""
    from rl_core.inference.launch import TorchEngineServer
    from tests.distill_teacher import rl_teacher, task_of

    server = TorchEngineServer(model, host="127.0.0.1", num_threads=1, weight_version=0)
    server.start()
    try:
        server.wait_healthy(timeout=120)
        warm, rewards = asyncio.run(
            rl_teacher(model, server.url, out, steps=steps, task=task_of("demo"))
        )
    finally:
        server.stop()
    print(f"warm-up: {steps} demo steps, reward {rewards[0]:.2f} -> {rewards[-1]:.2f}", flush=True)
    return warm


async def measure(rest: httpx.Client, key: str, model: Path, kind: str, args) -> dict:
    roles = kind == "roles"
    created = rest.post(
        "/runs/",
        json={
            "name": f"game-{kind}",
            "base_model": str(model),
            "max_steps": args.steps,
            **SETTINGS,
            "batch_size": 2 * args.episodes,
            "learning_rate": args.lr,
            **({"roles": ["speaker", "listener"]} if roles else {}),
        },
    )
    if created.status_code != 201:
        raise SystemExit(f"the run was refused: {created.text}")
    run = created.json()
    agents = {}
    for role in ("speaker", "listener"):
        body = {"name": f"{role} ({kind})", "run": run["id"]} | ({"role": role} if roles else {})
        agent = rest.post("/agents/", json=body)
        if agent.status_code != 201:
            raise SystemExit(f"the agent was refused: {agent.text}")
        agents[role] = agent.json()
    rest.post(f"/runs/{run['id']}/start/")
    while rest.get(f"/runs/{run['id']}/").json()["status"] != "running":
        await asyncio.sleep(1.0)
    started = time.monotonic()
    episodes: list[dict] = []
    rng = random.Random(0)
    await asyncio.gather(
        *(
            _player(
                rest,
                key,
                run["id"],
                agents,
                rng,
                episodes,
                args.phrasings,
                args.listener_reward,
                args.group_by,
                args.speaker_tokens,
            )
            for _ in range(args.episodes)
        )
    )
    state = rest.get(f"/runs/{run['id']}/").json()
    if state["status"] != "completed":
        raise SystemExit(f"run {kind} ended {state['status']}: {state['error'][:2000]}")
    by_version: dict[int, list[dict]] = defaultdict(list)
    for episode in episodes:
        by_version[episode["version"]].append(episode)
    per_role = {
        role: {p["step"]: p["value"] for p in _metric(rest, run["id"], f"roles/{role}/reward")}
        for role in ("speaker", "listener")
    }
    return {
        "kind": kind,
        "steps": args.steps,
        "phrasings": args.phrasings,
        "listener_reward": args.listener_reward,
        "group_by": args.group_by,
        "speaker_tokens": args.speaker_tokens,
        "episodes_per_step": args.episodes,
        "learning_rate": args.lr,
        "wall_s": time.monotonic() - started,
        "episodes": len(episodes),
        "by_version": {
            v: {
                "episodes": len(eps),
                "success": sum(e["success"] for e in eps) / len(eps),
                "score": sum(e["score"] for e in eps) / len(eps),
            }
            for v, eps in sorted(by_version.items())
        },
        "role_reward": per_role,
    }


async def _player(
    rest,
    key: str,
    run_id: str,
    agents: dict,
    rng,
    episodes: list,
    phrasings: int,
    listener_reward: str,
    group_by: str,
    speaker_tokens: int,
) -> None:
    """Play episodes until the run stops running."""
    from openai import APIStatusError, AsyncOpenAI, RateLimitError

    from rl_core.toy import (
        GAME_LETTERS,
        SPEAKER_PHRASINGS,
        listener_named,
        listener_prompt,
        listener_score,
        shown_letter,
        speaker_prompt,
    )

    clients = {
        role: AsyncOpenAI(base_url=agent["base_url"], api_key=key, max_retries=0, timeout=60)
        for role, agent in agents.items()
    }
    try:
        while True:
            target = rng.choice(GAME_LETTERS)
            phrasing = rng.choice(SPEAKER_PHRASINGS[:phrasings])
            sessions = {}
            try:
                for role, client in clients.items():
                    group = (
                        f"{SPEAKER_PHRASINGS.index(phrasing)}-{target}"
                        if group_by == "prompt"
                        else ""
                    )
                    sessions[role] = await _start(client, group if role == "speaker" else "")
            except RateLimitError:
                # The run's admission budget is full: end what this episode opened (unrewarded,
                # so dropped), or it would hold its slot until the idle timeout.
                await _end_all(sessions)
                await asyncio.sleep(0.5)
                continue
            except APIStatusError:  # 503: the run completed
                return
            try:
                said = await _say(
                    sessions["speaker"], "policy", speaker_prompt(target, phrasing), speaker_tokens
                )
                heard = await _say(
                    sessions["listener"],
                    "policy",
                    listener_prompt(said.choices[0].message.content or ""),
                )
            except APIStatusError:
                return
            answer = heard.choices[0].message.content or ""
            score = listener_score(answer, target)
            rewards = {"speaker": score, "listener": score}
            if listener_reward == "heard":
                word = said.choices[0].message.content or ""
                rewards["listener"] = listener_score(answer, shown_letter(word) or target)
            for role, session in sessions.items():
                await session.post("/rl/set_reward", cast_to=object, body={"reward": rewards[role]})
                await session.post("/rl/end_session", cast_to=object, body={})
            version = int((heard.system_fingerprint or "steep-v0").removeprefix("steep-v"))
            episodes.append(
                {"version": version, "success": listener_named(answer, target), "score": score}
            )
    finally:
        for client in clients.values():
            await client.close()


async def _end_all(sessions: dict) -> None:
    from openai import APIStatusError

    for session in sessions.values():
        try:
            await session.post("/rl/end_session", cast_to=object, body={})
        except APIStatusError:
            pass


async def _start(client, group: str = ""):
    body = {"task_id": "game"} | ({"metadata": {"group_id": group}} if group else {})
    started = await client.post("/rl/start_session", cast_to=object, body=body)
    return client.with_options(api_key=started["api_key"])


async def _say(session, model: str, prompt: str, max_tokens: int = MAX_TOKENS):
    return await session.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=1.0,
    )


def _metric(rest, run_id: str, name: str) -> list[dict]:
    out, page = [], f"/runs/{run_id}/metrics/?name={name}&page_size=500"
    while page:
        body = rest.get(page).json()
        out += body["results"]
        page = body["next"]
    return out


def table(result: dict, every: int = 1) -> str:
    """``result`` as markdown: per policy version, or per block of ``every`` versions (the
    episodes' success and score weighted by episodes, each role's reward the mean of its
    steps in the block)."""
    lines = [
        f"### {result['kind']}: {result['episodes']} episodes in {result['wall_s']:.0f} s",
        "",
        "| versions | episodes | success | score | speaker reward | listener reward |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    roles = {r: {int(k): v for k, v in steps.items()} for r, steps in result["role_reward"].items()}
    blocks: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    for version, row in result["by_version"].items():
        blocks[int(version) // every].append((int(version), row))
    for rows in blocks.values():
        versions = [v for v, _ in rows]
        episodes = sum(row["episodes"] for _, row in rows)
        success = sum(row["success"] * row["episodes"] for _, row in rows) / episodes
        score = sum(row["score"] * row["episodes"] for _, row in rows) / episodes
        cells = []
        for role in ("speaker", "listener"):
            values = [roles[role][v] for v in versions if v in roles[role]]
            cells.append(f"{sum(values) / len(values):.3f}" if values else "-")
        label = str(versions[0]) if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"
        lines.append(
            f"| {label} | {episodes} | {success:.2f} | {score:.3f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
