"""A simulated cluster run: Steep's own dataset-mode run (``rl_core.rollout.LocalRun``: rollout
driver, staleness controller, queue, ``TrainingLoop``, weight sync) against ``servers``
``SimServer`` stand-ins and a ``SimTrainer`` of ``trainer_gpus`` GPUs, in simulated time.

Nothing of the loop is re-implemented: the stand-ins are reached through
``rl_core.inference.client.IN_PROCESS_TRANSPORTS`` (the driver's and the weight sync's
``InferenceClient`` go through an in-process ASGI transport instead of sockets), and the
whole run executes on ``SimEventLoop``, whose clock jumps to the next timer. A run of hours
of cluster time takes seconds of wall time, and its results (simulated seconds) do not
depend on how loaded the machine running it is.

Response lengths (``lengths``): ``longtail`` draws each answer's length from a Pareto
distribution (tail index 1, from ``min_tokens``, capped at ``max_tokens``): most answers
short, a few at the cap, the shape of reasoning-model lengths behind AReaL's argument;
``uniform`` draws from a uniform distribution with the same mean. Each answer's length is
a function of its ``sampling_seed`` (``rl_core.rollout.member_seed``), so the synchronous
and asynchronous runs of one seed see the same answers in the same order.
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import httpx

from rl_core.adapter_sync import AdapterSync
from rl_core.chat import ChatTokenizer
from rl_core.config import RunConfig
from rl_core.inference.adapters import AdapterSwitch, move_lag
from rl_core.inference.client import IN_PROCESS_TRANSPORTS
from rl_core.loop import ListReporter
from rl_core.rollout import LocalRun
from rl_core.sim.clock import run_simulated
from rl_core.sim.cost import ENGINE_PRESETS, MEASURED_TRAINER_MFU, TrainerCost
from rl_core.sim.server import SimServer
from rl_core.sim.trainer import SimTrainer

LENGTHS = ("longtail", "uniform")
# "lora": adapters, the answers in flight moved onto each new one (what the Ray job does);
# "lora-keep": each answer keeps the adapter it started with (Steep before AdapterSwitch).
SYNCS = ("distributed", "disk", "lora", "lora-keep")


@dataclass
class ClusterSimConfig:
    """One simulated run. Token counts are real tokens; ``tokens_per_id`` only coarsens the wire."""

    servers: int = 4  # inference servers (one GPU each)
    trainer_gpus: int = 2  # trainer stand-ins (data-parallel GPUs)
    model: str = "1.5b"  # an ENGINE_PRESETS key
    max_staleness: int = 4  # 0 = synchronous RL
    batch_size: int = 64  # trajectories per training step
    group_size: int = 8  # answers per prompt
    steps: int = 20  # training steps to run
    lengths: str = "longtail"  # "longtail" | "uniform"
    min_tokens: int = 512  # the shortest answer
    max_tokens: int = 16_384  # max_new_tokens: the longest answer
    prompt_tokens: int = 256  # every prompt's length
    tokens_per_id: int = 16  # real tokens per simulated output id
    weight_sync: str = "distributed"  # one of SYNCS
    mfu: float = MEASURED_TRAINER_MFU  # the trainer's achieved fraction of peak FLOP/s
    max_queued_batches: int = 0  # RunConfig's: finished batches that may wait for the trainer
    lora_move_lag: int = 0  # "lora": moved once its adapter is this many versions old; 0: move_lag
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths {self.lengths!r}: use one of {LENGTHS}")
        if self.weight_sync not in SYNCS:
            raise ValueError(f"weight_sync {self.weight_sync!r}: use one of {SYNCS}")
        if self.model not in ENGINE_PRESETS:
            raise ValueError(f"model {self.model!r}: use one of {sorted(ENGINE_PRESETS)}")

    def mean_length(self) -> float:
        """The mean answer length of the long-tailed distribution (both have it)."""
        lo, hi = self.min_tokens, self.max_tokens
        return lo * (1.0 + math.log(hi / lo))  # Pareto(1) from lo, capped at hi

    def mean_square_length(self) -> float:
        """``E[L^2]`` of the answer lengths (capped Pareto: ``2·lo·hi - lo²``)."""
        lo, hi = self.min_tokens, self.max_tokens
        if self.lengths == "longtail":
            return 2.0 * lo * hi - lo * lo
        top = 2.0 * self.mean_length() - lo
        return (lo * lo + lo * top + top * top) / 3.0

    def length_fn(self) -> Callable[[int], int]:
        """Seed → answer length in real tokens."""
        lo, hi, mean = self.min_tokens, self.max_tokens, self.mean_length()
        if self.lengths == "longtail":
            return lambda seed: min(hi, int(lo / (1.0 - random.Random(seed).random())))
        top = 2.0 * mean - lo
        return lambda seed: int(random.Random(seed).uniform(lo, top))

    def trainer_cost(self) -> TrainerCost:
        return TrainerCost(
            params=ENGINE_PRESETS[self.model].params, gpus=self.trainer_gpus, mfu=self.mfu
        )


@dataclass
class ClusterSimResult:
    """What a simulated run measured (times are simulated seconds)."""

    config: dict[str, Any]
    sim_seconds: float  # from the start to the last step's report
    steps: int
    trajectories_per_s: float
    trained_tokens_per_s: float  # real response tokens trained per second
    inference_idle: float  # fraction of the servers' GPU time not decoding or prefilling
    trainer_idle: float  # fraction of the trainer's GPU time not in train_step
    staleness: dict[int, int]  # real trained tokens by versions behind
    max_staleness_seen: int
    dropped: int  # trajectories dropped as too stale
    sync_seconds: float  # mean simulated time of one weight sync (the loop's phase)
    inference_paused_s: float  # total time servers held requests paused for updates
    ideal_trajectories_per_s: float  # the analytic bound: perfect overlap, no tail waiting
    ideal_tokens_per_s: float = 0.0  # the same bound in trained response tokens/s
    # The bound in tokens, less what the per-token staleness rule must mask (per_token_bound).
    fresh_tokens_per_s: float = 0.0
    mean_batch: float = 0.0  # requests in a server's running batch, time-weighted over decoding
    # Where the staleness budget's (max_staleness + 1) * batch_size slots were, time-averaged
    # over the run (``Occupancy``): decoding, waiting at a server, finished but waiting for
    # the rest of the group, queued for the trainer, in the step being trained, and free.
    slots: dict[str, float] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)

    @property
    def staleness_ok(self) -> bool:
        return self.max_staleness_seen <= int(self.config["max_staleness"])


class _StubTokenizer:
    """What the rollout driver needs of a ChatTokenizer: ``prompt_ids`` ids per prompt."""

    def __init__(self, prompt_ids: int):
        self.prompt_ids = prompt_ids
        self.eos_token_ids = [2]

    def render(self, messages: list[dict]) -> str:
        return str(messages[-1]["content"])

    def encode(self, text: str) -> list[int]:
        return [7] * self.prompt_ids

    def decode(self, ids: list[int], **_: Any) -> str:
        return ""


def _reward(prompt: str, completion: str, answer: Any, metadata: dict) -> float:
    return float(metadata.get("row_index", 0) % 2)  # irrelevant to timing


class _TimedSync:
    """Wraps a weight sync to time its ``push`` in simulated seconds (the loop's own timer is wall time)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.reporter = inner.reporter
        self.seconds: list[float] = []

    @property
    def last_timing(self) -> dict[str, float]:
        return self.inner.last_timing

    async def push(self, trainer: Any) -> int:
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.inner.reporter = self.reporter
        version = await self.inner.push(trainer)
        self.seconds.append(loop.time() - started)
        return int(version)

    async def aclose(self) -> None:
        await self.inner.aclose()


class SimTimesReporter(ListReporter):
    """Remembers the simulated time of each step's report."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    async def metrics(self, step: int, version: int, values: dict[str, float]) -> None:
        self.times.append(asyncio.get_running_loop().time())
        await super().metrics(step, version, values)


class Occupancy:
    """Samples, every ``interval`` simulated seconds, where the admission budget's slots are.

    The budget ``(max_staleness + version + 1) * batch_size - trained`` counts a rollout from
    admission until it is trained; by Little's law the trajectory rate is at most the budget
    over the mean time a slot is held, so where that time goes is where throughput goes.
    """

    STATES = ("decoding", "at_server", "group_wait", "queued", "training", "free")

    def __init__(self, servers: list[SimServer], run: LocalRun, interval: float = 0.25):
        self.servers, self.run, self.interval = servers, run, interval
        self.sums = dict.fromkeys(self.STATES, 0.0)
        self.samples = 0

    def sample(self) -> None:
        c, q = self.run.controller, self.run.source.qsize()
        decoding = sum(s.decoding for s in self.servers)
        at_server = sum(s.waiting for s in self.servers)
        budget = (c.max_staleness + 1) * c.batch_size
        outstanding = c.accepted - c.version * c.batch_size  # queued or being trained
        for name, value in (
            ("decoding", decoding),
            ("at_server", at_server),
            ("group_wait", c.running - decoding - at_server),
            ("queued", q),
            ("training", outstanding - q),
            ("free", budget - outstanding - c.running),
        ):
            self.sums[name] += value
        self.samples += 1

    async def run_forever(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    def averages(self) -> dict[str, float]:
        return {k: v / max(1, self.samples) for k, v in self.sums.items()}


def _bound_step(
    cfg: ClusterSimConfig, sync_s: float, batch: int | None = None
) -> tuple[float, float]:
    """The bound's step time and the per-request decode rate (tokens/s) when every server
    decodes ``batch`` requests (default: the most the staleness budget lets decode)."""
    engine = ENGINE_PRESETS[cfg.model]
    mean = cfg.mean_length()
    # The cache a running request holds, averaged over time: long answers are running for
    # longer, so the in-flight mix is length-biased and its mean generated context is
    # E[L^2] / (2 E[L]) (7,200 tokens for the long tail, not mean / 2 = 2,300).
    context = cfg.prompt_tokens + cfg.mean_square_length() / (2 * mean)
    if batch is None:
        batch = max_decoding(cfg)
    rate = 1.0 / engine.step_seconds(batch, int(batch * context))  # tokens/s of one request
    gen_s = cfg.batch_size * mean / (cfg.servers * batch * rate)
    prefill_s = cfg.batch_size * cfg.prompt_tokens * engine.prefill_per_token_s / cfg.servers
    train_s = cfg.trainer_cost().step_seconds(int(cfg.batch_size * (cfg.prompt_tokens + mean)))
    if cfg.max_staleness == 0:  # synchronous: generation and training take turns
        return gen_s + prefill_s + train_s + sync_s, rate
    return max(gen_s + prefill_s, train_s + sync_s), rate


def max_decoding(cfg: ClusterSimConfig) -> int:
    """Requests per server the staleness budget lets decode with the trainer never idle.

    The budget is ``(max_staleness + 1) * batch_size`` and one batch of it is always the one
    being trained, so ``max_staleness`` batches decode (synchronous RL: its one batch), at
    most SGLang's ``max_running_requests`` per server.
    """
    in_flight = max(1, cfg.max_staleness) * cfg.batch_size
    return min(
        ENGINE_PRESETS[cfg.model].max_running_requests,
        max(1, math.ceil(in_flight / cfg.servers)),
    )


def ideal_trajectories_per_s(cfg: ClusterSimConfig, *, sync_s: float = 0.0) -> float:
    """The analytic bound: generation and training overlap perfectly and no server waits
    for a tail. Every server decodes the most requests the staleness rule lets decode
    (``max_decoding``) all the time, so a step takes the longer of generating a batch at
    that rate and training it (plus the loop's weight sync). Synchronous RL
    (``max_staleness`` 0) cannot overlap them: its step is the sum of generating its one
    batch and training it."""
    step_s, _ = _bound_step(cfg, sync_s)
    return cfg.batch_size / step_s


def _sample_groups(cfg: ClusterSimConfig, groups: int) -> list[list[int]]:
    lengths, rng = cfg.length_fn(), random.Random(f"fresh:{cfg.seed}")
    return [[lengths(rng.getrandbits(62)) for _ in range(cfg.group_size)] for _ in range(groups)]


def _fresh_share(groups: list[list[int]], window: float) -> float:
    generated = trained = 0.0
    for group in groups:
        start = max(0.0, max(group) - window)
        generated += sum(group)
        trained += sum(max(0.0, n - start) for n in group)
    return trained / generated


def fresh_fraction(
    cfg: ClusterSimConfig, *, sync_s: float = 0.0, batch: int | None = None, groups: int = 4000
) -> float:
    """The share of generated tokens the per-token staleness rule lets train at the bound.

    The bound above counts every generated token as trained. Steep's rule is per token: one
    generated more than ``max_staleness`` versions before its step is masked out of the
    loss. At the bound (servers decoding ``batch``) a version lasts ``T`` (its step time)
    and an answer decodes at the per-request rate ``r``; a group is trained the moment its
    last member finishes (no queueing), and its members started together, so a token is
    fresh only if it was generated in the last ``(max_staleness + 1) * T`` seconds before
    that moment (an upper bound on the window: ``max_staleness`` whole versions plus the
    one under way). Member ``i`` of a group whose longest answer is ``L_max`` then trains
    ``max(0, L_i - (L_max - r * (max_staleness + 1) * T))`` tokens. Averaged over
    ``groups`` seeded groups drawn from the run's length distribution (deterministic).
    Synchronous RL trains everything it generates: 1.
    """
    if cfg.max_staleness == 0:
        return 1.0
    step_s, rate = _bound_step(cfg, sync_s, batch)
    return _fresh_share(_sample_groups(cfg, groups), rate * (cfg.max_staleness + 1) * step_s)


def per_token_bound(
    cfg: ClusterSimConfig, *, sync_s: float = 0.0, groups: int = 2000
) -> tuple[float, int]:
    """The most trained tokens/s any per-server batch allows under the per-token rule, and
    that batch: the bound in tokens times ``fresh_fraction``, maximised over the batch
    (a smaller batch decodes each answer faster, so less of it goes stale, but generates
    less). Slowing the steps down instead never helps: with the decode rate fixed, the
    fresh tokens of a step grow at most linearly with its length."""
    if cfg.max_staleness == 0:
        return ideal_trajectories_per_s(cfg, sync_s=sync_s) * cfg.mean_length(), max_decoding(cfg)
    sample, best = _sample_groups(cfg, groups), (0.0, 1)
    for batch in range(1, max_decoding(cfg) + 1):
        step_s, rate = _bound_step(cfg, sync_s, batch)
        window = rate * (cfg.max_staleness + 1) * step_s
        tokens = cfg.batch_size / step_s * cfg.mean_length() * _fresh_share(sample, window)
        best = max(best, (tokens, batch))
    return best


async def _simulate(cfg: ClusterSimConfig, work: str) -> ClusterSimResult:
    engine, trainer_cost = ENGINE_PRESETS[cfg.model], cfg.trainer_cost()
    g = cfg.tokens_per_id
    lengths = cfg.length_fn()
    servers = [
        SimServer(engine, trainer_cost, lengths, tokens_per_id=g) for _ in range(cfg.servers)
    ]
    urls = [f"http://sim-{i}.invalid:30000" for i in range(cfg.servers)]
    for url, server in zip(urls, servers, strict=True):
        IN_PROCESS_TRANSPORTS[url] = httpx.ASGITransport(app=cast(Any, server))
    lora = cfg.weight_sync.startswith("lora")
    run_cfg = RunConfig.from_dict(
        {
            "base_model": f"sim-{cfg.model}",
            "reward": {"type": "exact_match"},  # replaced by _reward: only timing matters
            "batch_size": cfg.batch_size,
            "group_size": cfg.group_size,
            "max_new_tokens": -(-cfg.max_tokens // g),
            "max_staleness": cfg.max_staleness,
            "max_queued_batches": cfg.max_queued_batches,
            "max_steps": cfg.steps,
            "save_every": 10**6,
            "seed": cfg.seed,
            "weight_sync": "disk" if cfg.weight_sync == "disk" else "distributed",
            **({"lora_rank": 32} if lora else {}),
        }
    )
    trainer = SimTrainer(trainer_cost, tokens_per_id=g)
    reporter = SimTimesReporter()
    try:
        run = LocalRun(
            run_cfg,
            trainer=trainer,
            urls=urls,
            rows=[{"prompt": f"problem {i}", "answer": "0"} for i in range(1024)],
            weights_dir=f"{work}/weights",
            reporter=reporter,
            tokenizer=cast(ChatTokenizer, _StubTokenizer(-(-cfg.prompt_tokens // g))),
            reward_fn=_reward,
        )
        inner: Any = run.weight_sync
        if lora:  # what the Ray job does for a LoRA run: adapters, no pause
            lag = cfg.lora_move_lag or move_lag(cfg.max_staleness)  # 0: what the Ray job uses
            switch = AdapterSwitch(lag) if cfg.weight_sync == "lora" else None
            inner = AdapterSync(urls, f"{work}/adapters", "sim", switch=switch)
            run.driver.adapter_prefix, run.driver.adapter_switch = "sim", switch
        timed = _TimedSync(inner)
        run.loop.weight_sync = cast(Any, timed)
        occupancy = Occupancy(servers, run)
        sampler = asyncio.create_task(occupancy.run_forever())
        try:
            await run.run(cfg.steps)
        finally:
            sampler.cancel()
        if lora:
            await inner.aclose()
    finally:
        for url, server in zip(urls, servers, strict=True):
            IN_PROCESS_TRANSPORTS.pop(url, None)
            await server.aclose()
    end = reporter.times[-1] if reporter.times else asyncio.get_running_loop().time()
    steps = len(reporter.times)
    busy = sum(s.stats.busy_s for s in servers)
    sync_s = sum(timed.seconds) / len(timed.seconds) if timed.seconds else 0.0
    return ClusterSimResult(
        config=asdict(cfg),
        sim_seconds=end,
        steps=steps,
        trajectories_per_s=trainer.trained_trajectories / end,
        trained_tokens_per_s=trainer.trained_tokens / end,
        inference_idle=max(0.0, 1.0 - busy / (cfg.servers * end)),
        trainer_idle=max(0.0, 1.0 - trainer.busy_s / end),
        staleness=dict(sorted(trainer.staleness.items())),
        max_staleness_seen=max(trainer.staleness, default=0),
        dropped=int(sum(reporter.series("staleness/dropped"))),
        sync_seconds=sync_s,
        inference_paused_s=sum(s.stats.paused_s for s in servers),
        ideal_trajectories_per_s=ideal_trajectories_per_s(cfg, sync_s=sync_s),
        ideal_tokens_per_s=ideal_trajectories_per_s(cfg, sync_s=sync_s) * cfg.mean_length(),
        fresh_tokens_per_s=per_token_bound(cfg, sync_s=sync_s)[0],
        mean_batch=sum(s.stats.batch_s for s in servers) / busy if busy else 0.0,
        slots=occupancy.averages(),
        step_times=list(reporter.times),
    )


def simulate(cfg: ClusterSimConfig) -> ClusterSimResult:
    """Run ``cfg`` on a fresh ``SimEventLoop`` (seconds of wall time) and measure it."""
    with tempfile.TemporaryDirectory(prefix="steep-sim-") as work:
        return run_simulated(_simulate(cfg, work))
