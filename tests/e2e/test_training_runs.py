"""Training runs end to end: REST → Celery → Ray job → torch engine + trainer → metrics back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from rl_core.toy import TOY_SETTINGS, toy_rows
from tests.judge_stub import StubJudge
from tests.livestack import wait_for
from webapp.gateway.models import Interaction, Session
from webapp.rewards.models import JudgeCall

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def run_state(rest, run_id: str) -> dict:
    return rest.get(f"/runs/{run_id}/").json()


def reward_series(rest, run_id: str) -> list[tuple[int, float]]:
    points, page = [], f"/runs/{run_id}/metrics/?name=rollout/reward&page_size=500"
    while page:
        body = rest.get(page).json()
        points += [(p["step"], p["value"]) for p in body["results"]]
        page = body["next"]
    return points


def create_dataset_run(rest, stack, **overrides) -> dict:
    body = "".join(json.dumps(row) + "\n" for row in toy_rows(128)).encode()
    dataset = rest.post(
        "/datasets/",
        data={"name": f"letters-{time.time_ns()}"},
        files={"file": ("letters.jsonl", body)},
    ).json()
    settings = {**TOY_SETTINGS, "max_steps": 14, "save_every": 5, **overrides}
    created = rest.post(
        "/runs/",
        json={
            "name": "letters",
            "mode": "dataset",
            "base_model": str(stack.model_dir),
            "dataset": dataset["id"],
            **settings,
        },
    )
    assert created.status_code == 201, created.text
    return created.json()


def watch_websocket(
    stack, run_id: str, user, events: list, stop: threading.Event
) -> threading.Thread:
    """Collect the run's websocket events in a thread, logged in as ``user``."""
    import websockets
    from django.test import Client

    browser = Client()
    browser.force_login(user)
    cookie = f"sessionid={browser.cookies['sessionid'].value}"

    async def listen():
        uri = stack.url.replace("http", "ws") + f"/ws/runs/{run_id}/?since_step=-1"
        async with websockets.connect(
            uri, additional_headers={"Cookie": cookie, "Origin": stack.url}
        ) as socket:
            while not stop.is_set():
                try:
                    events.append(json.loads(await asyncio.wait_for(socket.recv(), 1.0)))
                except TimeoutError:
                    continue

    thread = threading.Thread(target=lambda: asyncio.run(listen()), daemon=True)
    thread.start()
    return thread


def test_dataset_run_trains_reports_live_checkpoints_and_stops(stack, rest, owner):
    # Held-out rows evaluated every 5 steps by the worker while the job trains on.
    evals = {"eval_every": 5, "eval_fraction": 0.1, "eval_k": 2, "eval_max_examples": 4}
    run = create_dataset_run(rest, stack, max_steps=200, **evals)
    events: list[dict] = []
    stop_ws = threading.Event()
    watcher = watch_websocket(stack, run["id"], owner, events, stop_ws)
    try:
        assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
        wait_for(
            lambda: run_state(rest, run["id"])["status"] == "running",
            180,
            f"the run to be running\n{stack.log_tail()}",
        )
        wait_for(
            lambda: run_state(rest, run["id"])["step"] >= 12,
            300,
            f"12 training steps\n{stack.log_tail()}",
        )

        def reward_rose() -> bool:
            # It rises once the policy first samples the target (after ~10-40 steps).
            rewards = [value for _, value in sorted(reward_series(rest, run["id"]))]
            return (
                len(rewards) >= 8
                and statistics.mean(rewards[-4:]) > statistics.mean(rewards[:3]) + 0.2
            )

        wait_for(
            reward_rose,
            400,
            f"the reward to rise\n{reward_series(rest, run['id'])}\n{stack.log_tail()}",
        )

        checkpoints = rest.get(f"/runs/{run['id']}/checkpoints/").json()["results"]
        assert checkpoints, "a checkpoint every 5 steps"
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoints[0]["path"])
        assert model.config.vocab_size > 0

        assert rest.post(f"/runs/{run['id']}/stop/").status_code == 202
        wait_for(
            lambda: run_state(rest, run["id"])["status"] == "stopped",
            180,
            f"the run to stop\n{stack.log_tail()}",
        )
        final = run_state(rest, run["id"])
        assert any(e["kind"] == "checkpoint" for e in final["events"])
        # Training went past the first eval step without waiting for its eval, and each
        # eval step's checkpoint got exactly one scheduled eval, which finishes.
        scheduled = rest.get(f"/runs/{run['id']}/evals/?page_size=500").json()["results"]
        steps = sorted(e["step"] for e in scheduled if e["scheduled"])
        assert final["step"] >= 12 and steps[:2] == [5, 10], scheduled
        assert steps == list(range(5, 5 * len(steps) + 1, 5)), steps
        first = next(e for e in scheduled if e["step"] == 5)
        wait_for(
            lambda: (
                rest.get(f"/runs/{run['id']}/evals/{first['id']}/").json()["status"]
                in ("done", "failed")
            ),
            300,
            f"the step-5 eval to finish\n{stack.log_tail()}",
        )
        done = rest.get(f"/runs/{run['id']}/evals/{first['id']}/").json()
        assert done["status"] == "done", done["error"]
        assert done["split"] == "held_out" and done["examples"] == 4
        eval_points = rest.get(f"/runs/{run['id']}/metrics/?name=eval/mean_reward").json()
        assert 5 in {p["step"] for p in eval_points["results"]}
    finally:
        stop_ws.set()
        watcher.join(timeout=5)
    metric_steps = {event["step"] for event in events if event.get("type") == "metrics"}
    assert len(metric_steps) >= 5, events[:3]
    assert any(
        event.get("type") == "status" and event.get("status") == "running" for event in events
    )


def test_a_dataset_run_on_two_train_workers_learns_and_checkpoints(stack, rest):
    """train_workers=2: two trainer actors (FSDP2 over gloo) on the local head's CPUs."""
    run = create_dataset_run(rest, stack, train_workers=2, max_steps=24, save_every=8)
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, run["id"])["status"] in ("completed", "failed"),
        900,
        f"the run to finish\n{stack.log_tail()}",
    )
    final = run_state(rest, run["id"])
    assert final["status"] == "completed", final["error"]
    assert final["step"] == 24
    rewards = [value for _, value in sorted(reward_series(rest, run["id"]))]
    assert statistics.mean(rewards[-4:]) > statistics.mean(rewards[:3]) + 0.2, rewards
    checkpoints = rest.get(f"/runs/{run['id']}/checkpoints/").json()["results"]
    assert max(c["step"] for c in checkpoints) == 24


def test_a_run_the_cluster_cannot_hold_fails_saying_what_it_needs(stack, rest):
    from webapp.runs.models import ClusterReport

    # As if the run was created before any job reported the cluster (or before it shrank):
    # the job itself refuses it. The local head offers 8 CPUs; 8 trainer workers and 1 torch
    # engine need 9.
    ClusterReport.objects.all().delete()
    run = create_dataset_run(rest, stack, train_workers=8)
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, run["id"])["status"] == "failed",
        180,
        f"the run to fail\n{stack.log_tail()}",
    )
    numbers = "train_workers=8 and 1 torch-engine inference server need 9 CPUs; the cluster has 8."
    error = run_state(rest, run["id"])["error"]
    assert error.startswith(f"CapacityError: {numbers}"), error

    # The job reported the cluster on its way: the same run is now refused when created.
    again = rest.post(f"/runs/{run['id']}/clone/", json={})
    assert again.status_code == 400, again.text
    assert numbers in again.json()["error"]["fields"]["train_workers"][0]


def test_online_agents_train_while_running_within_the_staleness_bound(stack, rest, project):

    from webapp.gateway.models import Session

    max_staleness, batch = 1, 4
    created = rest.post(
        "/runs/",
        json={
            "name": "online",
            "mode": "online",
            "base_model": str(stack.model_dir),
            "batch_size": batch,
            "max_staleness": max_staleness,
            "max_steps": 6,
            "learning_rate": 1e-3,
            "save_every": 3,
        },
    )
    run = created.json()
    agent = rest.post("/agents/", json={"name": "e2e agent", "run": run["id"]}).json()
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, run["id"])["status"] == "running",
        180,
        f"the run to be running\n{stack.log_tail()}",
    )

    seen_versions, ended = _agents_until_the_run_ends(rest, run, agent)

    wait_for(
        lambda: run_state(rest, run["id"])["status"] == "completed",
        240,
        f"the run to complete\n{stack.log_tail()}",
    )
    assert len(seen_versions) > 1, "the policy version served changed while agents kept running"

    sessions = {str(s.id): s for s in Session.objects.filter(run_id=run["id"])}
    trained = [s for s in sessions.values() if s.trajectory == "trained"]
    assert (
        len(trained) >= 6 * batch - max_staleness * batch
    )  # every step trained a full batch (dropped ones excepted)
    assert all(sessions[sid].trajectory in ("trained", "dropped", "ready") for sid in ended)
    for session in trained:
        versions = [
            v for turn in session.interactions.all() for v in turn.outputs[turn.chosen]["versions"]
        ]
        # Tokens older than the bound stay as context, out of the loss (rl_core.staleness.
        # mask_stale, checked token by token in tests/rl_core/test_long_episodes.py); a session
        # is trained only when some of its tokens were fresh enough to be in it.
        assert session.trained_version - max(versions) <= max_staleness + 1, (
            session.trained_version,
            versions,
        )

    # The new weights reached the server by broadcast every step (weight_sync's default,
    # through the Ray trainer worker's own group), never by the disk fallback.
    from webapp.runs.models import MetricPoint, RunEvent

    assert not RunEvent.objects.filter(run_id=run["id"], kind="weight_sync").exists()
    moved = MetricPoint.objects.filter(run_id=run["id"], name="weight_sync/bytes")
    assert moved.count() == 6 and all(point.value > 0 for point in moved)
    assert not MetricPoint.objects.filter(run_id=run["id"], name="timing/save_weights").exists()


def said_a(reply: str) -> float:
    return float("a" in reply)


def _agents_until_the_run_ends(
    rest, run, agent, hint: str | None = None, reward_of: Callable[[str], float] = said_a
) -> tuple[set[int], list[str]]:
    """Agents play 2-turn sessions (temperature 1, rewarded ``reward_of`` the last reply: for
    an "a" unless told) through the gateway with the official openai SDK until the run stops
    running; the policy versions they were served and the ids of the sessions they ended.
    ``hint``: sent with every reward 0."""
    from openai import APIStatusError, OpenAI

    project_key = rest.headers["Authorization"].split()[1]
    seen_versions: set[int] = set()
    ended: list[str] = []
    deadline = time.monotonic() + 300
    while run_state(rest, run["id"])["status"] == "running" and time.monotonic() < deadline:
        started = httpx.post(
            f"{agent['base_url']}/rl/start_session",
            headers={"Authorization": f"Bearer {project_key}"},
            json={"task_id": "e2e"},
        )
        if started.status_code == 429:
            time.sleep(float(started.headers["Retry-After"]) / 4)
            continue
        if started.status_code == 503:
            break  # the run completed between the check and the call
        assert started.status_code == 201, started.text
        session = started.json()
        client = OpenAI(base_url=agent["base_url"], api_key=session["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "Say a."}]
        try:
            for _ in range(2):
                reply = client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=4, temperature=1.0
                )
                seen_versions.add(int(reply.system_fingerprint.removeprefix("steep-v")))
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "Again."},
                ]
        except APIStatusError as error:
            # The run reached max_steps while this session was mid-conversation: the
            # gateway answers 503 and the episode is simply not trained.
            assert error.status_code == 503, error
            assert run_state(rest, run["id"])["status"] != "running"
            break
        auth = {"Authorization": f"Bearer {session['api_key']}"}
        reward = reward_of(reply.choices[0].message.content or "")
        body = {"reward": reward} | ({"hint": hint} if hint and not reward else {})
        assert (
            httpx.post(f"{agent['base_url']}/rl/set_reward", headers=auth, json=body).status_code
            == 200
        )
        assert httpx.post(f"{agent['base_url']}/rl/end_session", headers=auth).status_code == 200
        ended.append(session["session_id"])

    return seen_versions, ended


def _pids_whose_command_has(fragment: str) -> list[int]:
    """The processes whose command line contains ``fragment`` (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if fragment in command:
            pids.append(int(entry.name))
    return pids


def online_lora_run_played(
    rest,
    stack,
    name: str,
    hint: str | None = None,
    agent_role: str = "",
    reward_of: Callable[[str], float] = said_a,
    **settings,
) -> tuple[dict, set[int], list[str]]:
    """An online LoRA run of 3 steps (batch 4, ``settings`` on top) created, started and
    played by agents (bound to ``agent_role`` when given) until it stops running: (the run,
    the versions served, the sessions ended)."""
    created = rest.post(
        "/runs/",
        json={
            "name": name,
            "mode": "online",
            "base_model": str(stack.model_dir),
            "batch_size": 4,
            "max_staleness": 2,
            "max_steps": 3,
            "learning_rate": 1e-2,
            "lora_rank": 4,
            "save_every": 3,
            **settings,
        },
    )
    assert created.status_code == 201, created.text
    run = created.json()
    role = {"role": agent_role} if agent_role else {}
    agent = rest.post("/agents/", json={"name": f"{name} agent", "run": run["id"], **role})
    assert agent.status_code == 201, agent.text
    agent = agent.json()
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, run["id"])["status"] == "running",
        300,
        f"the run to be running\n{stack.log_tail()}",
    )
    seen_versions, ended = _agents_until_the_run_ends(rest, run, agent, hint, reward_of)
    return run, seen_versions, ended


def test_an_online_lora_run_serves_each_version_as_an_adapter_without_pausing(stack, rest):
    from webapp.runs.models import MetricPoint, RunEvent

    run, seen_versions, _ = online_lora_run_played(rest, stack, "online lora")
    wait_for(
        lambda: run_state(rest, run["id"])["status"] == "completed",
        240,
        f"the run to complete\n{stack.log_tail()}",
    )
    # Versions 1.. were served as adapters <run>-v<N> loaded beside the base model: the
    # replies say which version answered, and no update stalled generation.
    assert len(seen_versions) > 1, seen_versions
    stalls = MetricPoint.objects.filter(run_id=run["id"], name="timing/inference_stall")
    assert stalls.count() == 3 and all(point.value == 0.0 for point in stalls)
    moved = MetricPoint.objects.filter(run_id=run["id"], name="weight_sync/bytes")
    model_bytes = sum(f.stat().st_size for f in Path(stack.model_dir).glob("*.safetensors"))
    assert moved.count() == 3
    assert all(0 < point.value < model_bytes / 2 for point in moved)  # an adapter, not the model
    assert not RunEvent.objects.filter(run_id=run["id"], kind__in=["weight_sync", "error"]).exists()


def test_a_killed_job_is_restarted_from_its_checkpoint_without_losing_trajectories(stack, rest):
    from webapp.gateway.models import Session
    from webapp.runs.models import Run

    run = create_dataset_run(rest, stack, max_steps=12, save_every=3)
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    wait_for(lambda: run_state(rest, run["id"])["step"] >= 4, 300, f"4 steps\n{stack.log_tail()}")
    # A crash, not a stop: the job's driver process dies without reporting anything.
    drivers = _pids_whose_command_has(f"workers.ray_job --run-id {run['id']}")
    assert drivers, "the job's driver process was running"
    for pid in drivers:  # by PID: nothing but this run's driver (the run id is unique)
        os.kill(pid, signal.SIGKILL)

    wait_for(
        lambda: Run.objects.get(pk=run["id"]).job_attempt >= 2,
        120,
        f"the reconciler to relaunch\n{stack.log_tail()}",
    )
    wait_for(
        lambda: run_state(rest, run["id"])["status"] == "completed",
        400,
        f"the restarted run to complete\n{stack.log_tail()}",
    )
    final = run_state(rest, run["id"])
    kinds = [event["kind"] for event in final["events"]]
    assert "reconcile" in kinds and "resumed" in kinds, kinds
    assert final["step"] == 12
    states = list(Session.objects.filter(run_id=run["id"]).values_list("trajectory", flat=True))
    assert "claimed" not in states, "claimed-but-untrained trajectories were released, not lost"
    # Exactly once in the final lineage: what was trained after the checkpoint the job went
    # back to was trained again, each step one batch (tests/chaos checks this under more faults).
    ledger = rest.get(f"/runs/{run['id']}/ledger/").json()
    assert ledger["trained_by_step"] == [{"step": s, "count": 32} for s in range(1, 13)], ledger
    assert ledger["trained"] == states.count("trained") == 12 * 32
    assert ledger["balanced"] and ledger["trained_twice"] == [], ledger


def test_a_run_cloned_from_a_checkpoint_starts_from_its_weights(stack, rest):
    """Run again from a checkpoint: the clone's first rollouts come from the trained policy."""
    source = create_dataset_run(rest, stack, max_steps=20, save_every=10)
    assert rest.post(f"/runs/{source['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, source["id"])["status"] == "completed",
        600,
        f"the source run to complete\n{stack.log_tail()}",
    )
    trained = [value for _, value in sorted(reward_series(rest, source["id"]))]
    assert statistics.mean(trained[-3:]) > 0.5, trained  # it learned the toy task

    clone = rest.post(
        f"/runs/{source['id']}/clone/", json={"from_checkpoint": 20, "config": {"max_steps": 2}}
    )
    assert clone.status_code == 201, clone.text
    clone = clone.json()
    assert rest.post(f"/runs/{clone['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, clone["id"])["status"] == "completed",
        400,
        f"the clone to complete\n{stack.log_tail()}",
    )
    first = [value for _, value in sorted(reward_series(rest, clone["id"]))][0]
    # A fresh tiny model scores ~0.01 on its first batch (the source did: trained[0]).
    assert first > trained[0] + 0.4, (first, trained)
    assert "init" in [event["kind"] for event in run_state(rest, clone["id"])["events"]]


def test_a_dataset_run_judged_by_an_llm_trains_on_its_verdicts(stack, rest):
    """The job submits its episodes unscored; the worker's rewards.tick has a stand-in
    OpenAI-compatible judge (tests.judge_stub) score them; the trainer trains on the verdicts."""
    judge = StubJudge()
    judge.grader = lambda answer: 1.0 if "v" in answer else 0.0
    try:
        run = create_dataset_run(
            rest,
            stack,
            max_steps=1,
            batch_size=8,
            group_size=4,
            reward={
                "type": "judge",
                "rubric": "1 if the answer has the letter v in it, else 0.",
                "base_url": judge.base_url,
                "model": "stub-judge",
                "api_key": "sk-e2e-judge",
            },
        )
        assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
        deadline = time.monotonic() + 240
        while run_state(rest, run["id"])["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, run_state(rest, run["id"])
            time.sleep(1)
        state = run_state(rest, run["id"])
        assert state["status"] == "completed", state
        assert state["config"]["reward"]["api_key"] == "(stored encrypted)"
    finally:
        judge.close()

    trained = Session.objects.filter(run_id=run["id"], trajectory=Session.Trajectory.TRAINED)
    assert trained.count() >= 8  # a step of 8, every one judged before training
    turns = Interaction.objects.filter(session__in=trained)
    assert all(t.reward in (0.0, 1.0) for t in turns)
    assert [t.reward for t in turns] == [
        1.0 if "v" in t.response["choices"][0]["message"]["content"] else 0.0 for t in turns
    ]
    assert judge.requests and set(judge.auth) == {"Bearer sk-e2e-judge"}
    assert JudgeCall.objects.filter(run_id=run["id"], ok=True).exists()
