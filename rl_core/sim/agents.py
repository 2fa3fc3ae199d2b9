"""Simulated online agents: a population of multi-turn sessions admitted under the staleness
rule, their trajectories trained by Steep's own ``TrainingLoop`` with its weight sync.

Each agent loops over sessions. To start one it asks for admission (``StalenessController.
try_admit``, the rule the gateway applies as one SQL UPDATE and that
``tests/gateway/test_admission_rule_agrees.py`` holds equal); refused, it gets the gateway's
429 and waits ``Retry-After`` (``GATEWAY_RETRY_AFTER_S``, 2 s) before asking again: that wait
is the agent's *backing off* time. Admitted, it plays ``turns`` turns: ``/generate`` on its
sticky server with the whole conversation so far (a real ``InferenceClient`` through the
in-process transport), then a think time (tool calls, the user) before the next turn, which
appends ``observation_tokens``. The ended session becomes one trajectory (assistant tokens
trained, per-token versions as the server reported them) on the loop's ``QueueSource``.

What is not simulated: the gateway's own HTTP/database path (measured in
``docs/benchmarks/gateway.md``) and sessions that end without a reward.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from rl_core.config import RunConfig
from rl_core.inference.client import IN_PROCESS_TRANSPORTS, InferenceClient
from rl_core.loop import QueueSource, TrainingLoop
from rl_core.sim.clock import run_simulated
from rl_core.sim.cluster import ClusterSimConfig, SimTimesReporter
from rl_core.sim.cost import ENGINE_PRESETS
from rl_core.sim.server import SimServer
from rl_core.sim.trainer import SimTrainer
from rl_core.staleness import StalenessBudget, StalenessController
from rl_core.types import PROMPT_VERSION, Trajectory
from rl_core.weight_sync import WeightSync

RETRY_AFTER_S = 2.0  # webapp.settings.GATEWAY_RETRY_AFTER_S's default


@dataclass
class AgentSimConfig:
    """A population of online agents on a simulated cluster."""

    agents: int = 1000
    turns_min: int = 2  # turns per session, uniform in [turns_min, turns_max]
    turns_max: int = 6
    think_s: float = 5.0  # mean think time between turns (exponential)
    observation_tokens: int = 256  # tool result / user message tokens between turns
    retry_after_s: float = RETRY_AFTER_S


@dataclass
class AgentSimResult:
    """What the online simulation measured (simulated seconds)."""

    config: dict[str, Any]
    sim_seconds: float
    steps: int
    sessions_trained: int
    trajectories_per_s: float
    trained_tokens_per_s: float
    backoff_fraction: float  # of all agents' time, spent waiting after a 429
    refusals: int  # 429s answered
    staleness: dict[int, int]
    max_staleness_seen: int
    dropped: int
    inference_idle: float
    trainer_idle: float


async def _agents(cluster: ClusterSimConfig, agents: AgentSimConfig, work: str) -> AgentSimResult:
    engine, trainer_cost, g = (
        ENGINE_PRESETS[cluster.model],
        cluster.trainer_cost(),
        cluster.tokens_per_id,
    )
    servers = [
        SimServer(engine, trainer_cost, cluster.length_fn(), tokens_per_id=g)
        for _ in range(cluster.servers)
    ]
    urls = [f"http://sim-agent-{i}.invalid:30000" for i in range(cluster.servers)]
    for url, server in zip(urls, servers, strict=True):
        IN_PROCESS_TRANSPORTS[url] = httpx.ASGITransport(app=server)  # type: ignore[arg-type]
    cfg = RunConfig.from_dict(
        {
            "mode": "online",
            "base_model": f"sim-{cluster.model}",
            "batch_size": cluster.batch_size,
            "max_new_tokens": -(-cluster.max_tokens // g),
            "max_staleness": cluster.max_staleness,
            "max_steps": cluster.steps,
            "save_every": 10**6,
            "seed": cluster.seed,
        }
    )
    controller = StalenessController(*StalenessBudget.from_config(cfg.to_dict()))
    source = QueueSource()
    trainer = SimTrainer(trainer_cost, tokens_per_id=g)
    reporter = SimTimesReporter()
    sync = WeightSync(urls, f"{work}/weights", strategy="distributed")
    loop = TrainingLoop(cfg, trainer, source, sync, reporter, controller)
    clients = [InferenceClient(url) for url in urls]
    backoff = [0.0]
    refusals = [0]
    prompt_ids = -(-cluster.prompt_tokens // g)
    obs_ids = -(-agents.observation_tokens // g)

    async def agent(index: int) -> None:
        rng = random.Random(f"{cluster.seed}:{index}")
        client = clients[index % len(clients)]
        aloop = asyncio.get_running_loop()
        session = 0
        while True:
            while not controller.try_admit():
                refusals[0] += 1
                started = aloop.time()
                await asyncio.sleep(agents.retry_after_s)
                backoff[0] += aloop.time() - started
            session += 1
            ids, mask, versions = [7] * prompt_ids, [0] * prompt_ids, [PROMPT_VERSION] * prompt_ids
            accepted = False
            try:
                turns = rng.randint(agents.turns_min, agents.turns_max)
                for turn in range(turns):
                    if turn:
                        await asyncio.sleep(rng.expovariate(1.0 / agents.think_s))
                        ids += [8] * obs_ids
                        mask += [0] * obs_ids
                        versions += [PROMPT_VERSION] * obs_ids
                    seed = rng.getrandbits(62)
                    result = await client.generate(
                        ids, {"max_new_tokens": cfg.max_new_tokens, "sampling_seed": seed}
                    )
                    ids += result.output_ids
                    mask += [1] * len(result.output_ids)
                    versions += result.versions
                trajectory = Trajectory(
                    input_ids=ids,
                    loss_mask=mask,
                    logprobs=[0.0] * len(ids),
                    versions=versions,
                    rewards=[0.0] * turns,
                    session_id=f"{index}-{session}",
                )
                await source.put(trajectory.session_id, trajectory)
                accepted = True
            finally:
                controller.on_finish(accepted)

    tasks = [asyncio.create_task(agent(i)) for i in range(agents.agents)]
    aloop = asyncio.get_running_loop()
    try:
        await loop.run(cluster.steps)
        end = aloop.time()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        source.close()
        await sync.aclose()
        await asyncio.gather(*(c.aclose() for c in clients))
        for url, server in zip(urls, servers, strict=True):
            IN_PROCESS_TRANSPORTS.pop(url, None)
            await server.aclose()
    end = reporter.times[-1] if reporter.times else end
    busy = sum(s.stats.busy_s for s in servers)
    return AgentSimResult(
        config={**asdict(cluster), **asdict(agents)},
        sim_seconds=end,
        steps=len(reporter.times),
        sessions_trained=trainer.trained_trajectories,
        trajectories_per_s=trainer.trained_trajectories / end,
        trained_tokens_per_s=trainer.trained_tokens / end,
        backoff_fraction=backoff[0] / (agents.agents * end),
        refusals=refusals[0],
        staleness=dict(sorted(trainer.staleness.items())),
        max_staleness_seen=max(trainer.staleness, default=0),
        dropped=int(sum(reporter.series("staleness/dropped"))),
        inference_idle=max(0.0, 1.0 - busy / (cluster.servers * end)),
        trainer_idle=max(0.0, 1.0 - trainer.busy_s / end),
    )


def simulate_agents(cluster: ClusterSimConfig, agents: AgentSimConfig) -> AgentSimResult:
    """Run the online population on a fresh ``SimEventLoop`` and measure it."""
    with tempfile.TemporaryDirectory(prefix="steep-sim-agents-") as work:
        return run_simulated(_agents(cluster, agents, work))
