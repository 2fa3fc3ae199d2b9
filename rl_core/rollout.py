"""Dataset-mode rollouts: sample prompts, generate groups of answers, score them, hand them on.

``RolloutDriver`` is the workflow of a dataset run (AReaL-lite's ``RLVRWorkflow``):
for each prompt it renders the chat template, admits ``group_size`` rollouts
one at a time through the ``StalenessController`` (waiting while the staleness
budget is full), generates them concurrently on the inference servers, scores
each answer with the run's reward function and passes the complete group to a
``sink``. The sink is what differs between deployments: ``LocalRun`` puts the
trajectories on an in-process ``QueueSource``; a Ray job posts the episodes to
the web app's internal API (``Episode.to_dict`` is that API's episode format),
so dataset runs and agent sessions reach the trainer through one mechanism.

Imports neither torch nor Django.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_core.chat import ChatTokenizer, load_chat_tokenizer
from rl_core.checkpoints import latest_checkpoint
from rl_core.config import RunConfig
from rl_core.distill import TeacherScorer
from rl_core.inference.adapters import AdapterSwitch, current_adapter
from rl_core.inference.client import GenerateResult, InferenceClient
from rl_core.inference.vllm import client_for
from rl_core.loop import (
    LoopSummary,
    QueueSource,
    Reporter,
    Trainer,
    TrainingLoop,
    WeightSync,
)
from rl_core.rewards import RewardFn, load_reward_fn, score
from rl_core.sampling import TurnSampling
from rl_core.staleness import StalenessController
from rl_core.types import PROMPT_VERSION, Trajectory

logger = logging.getLogger(__name__)

_ROW_KEYS = ("prompt", "messages", "answer", "metadata")


@dataclass
class Episode:
    """One scored answer to one prompt: what the trainer and the web's records both need.

    ``input_ids`` is the rendered prompt, ``output_ids`` the generated tokens (the
    stop token included: the policy must learn to stop), with one behaviour
    ``logprobs`` and policy ``versions`` entry per output token.
    """

    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float | None  # None: the web app scores it after it is submitted (judge, human)
    finish_reason: str  # "stop" | "length" | "abort"
    text: str  # the decoded answer, special tokens skipped: what the reward function saw
    messages: list[dict]  # the prompt as chat messages
    group_id: str
    task_id: str = ""  # the dataset row's "id", else its index
    metadata: dict[str, Any] = field(default_factory=dict)  # answer, reward_error, ...
    sampling: dict[str, Any] = field(default_factory=dict)
    latency_ms: float = 0.0
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def to_trajectory(self) -> Trajectory:
        n_prompt = len(self.input_ids)
        temperature = TurnSampling.from_params(self.sampling).logprob_temperature
        return Trajectory(
            input_ids=[*self.input_ids, *self.output_ids],
            loss_mask=[0] * n_prompt + [1] * len(self.output_ids),
            logprobs=[0.0] * n_prompt + [float(x) for x in self.logprobs],
            versions=[PROMPT_VERSION] * n_prompt + list(self.versions),
            rewards=[float(_scored(self.reward))],
            group_id=self.group_id,
            session_id=self.episode_id,
            temperatures=None
            if temperature == 1.0
            else [1.0] * n_prompt + [temperature] * len(self.output_ids),
            metadata={
                "finish_reason": self.finish_reason,
                "task_id": self.task_id,
                **self.metadata,
            },
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe; the episode format of the internal API's dataset-mode submissions."""
        return {
            "input_ids": list(self.input_ids),
            "output_ids": list(self.output_ids),
            "logprobs": [float(x) for x in self.logprobs],
            "versions": list(self.versions),
            "reward": None if self.reward is None else float(self.reward),
            "finish_reason": self.finish_reason,
            "text": self.text,
            "messages": list(self.messages),
            "group_id": self.group_id,
            "task_id": self.task_id,
            "metadata": dict(self.metadata),
            "sampling": dict(self.sampling),
            "latency_ms": float(self.latency_ms),
        }


def _scored(reward: float | None) -> float:
    if reward is None:
        raise ValueError(
            "this episode's reward is given by the web app (a judge or human reward); only a"
            " run's job, which submits episodes to it, can train such a run"
        )
    return reward


Sink = Callable[[list[Episode]], Awaitable[None]]
SamplingOverrides = Callable[[dict[str, Any], random.Random], dict[str, Any]]


def row_messages(row: dict[str, Any]) -> list[dict]:
    """A dataset row's prompt as chat messages: ``messages`` as given, or ``prompt`` as one user turn."""
    if isinstance(row.get("messages"), list) and row["messages"]:
        return list(row["messages"])
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    raise ValueError(
        'a dataset row needs "prompt" (a string) or "messages" (a non-empty list of chat messages)'
    )


def row_metadata(row: dict[str, Any]) -> dict[str, Any]:
    """What a reward function gets as ``metadata``: the row's ``metadata`` plus its other fields."""
    meta = dict(row.get("metadata") or {})
    meta.update({k: v for k, v in row.items() if k not in _ROW_KEYS})
    return meta


def member_seed(run_seed: int, group: int, member: int) -> int:
    """The sampling seed of one group member: reproducible from the run's seed, distinct per member.

    SGLang and the torch engine take it as ``sampling_params["sampling_seed"]``; members
    of a group share a prompt, so they must not share a seed (identical answers give a
    group zero advantage). 63 bits, as both servers accept.
    """
    digest = hashlib.blake2b(f"{run_seed}:{group}:{member}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def prompt_order(n_rows: int, seed: int, used: Mapping[int, int] | None = None) -> Iterator[int]:
    """Dataset row indices without end: each epoch a fresh shuffle seeded by ``seed`` (the same
    sequence on every start), minus what a resumed run already used.

    ``used[i]`` groups of row ``i`` were already generated (submitted) in the run's lineage:
    its first ``used[i]`` occurrences in the sequence are skipped, so a resumed run continues
    its epoch where it was, with no prompt repeated before the epoch ends and none left out
    (a group lost in flight by the crash is generated again).
    """
    rng = random.Random(seed)
    skip = dict(used or {})
    while True:
        order = list(range(n_rows))
        rng.shuffle(order)
        for index in reversed(order):
            if skip.get(index, 0) > 0:
                skip[index] -= 1
            else:
                yield index


class RolloutDriver:
    """Generates, scores and submits groups of answers until ``stop()``.

    Prompts are drawn from ``rows`` in a reshuffled order each epoch (``prompt_order``, seeded
    by ``cfg.seed``; a resumed run passes ``rows_used`` and continues its epoch). Each group goes to the next server in turn (its members share
    a prompt, which SGLang's prefix cache reuses). Every group member is
    admitted by ``controller.try_admit()`` before it starts, so at most the
    staleness budget is in flight: as many rollouts as the controller allows run
    concurrently, and the servers batch them. A member finishes with
    ``controller.on_finish(accepted=True)`` when its group reaches the sink;
    a group whose generation failed is not submitted (``on_finish(False)``),
    so groups stay whole. A reward function that raises scores 0 and its error
    is kept in the episode's ``metadata["reward_error"]``. With no ``reward_fn`` (a judge
    or human reward) episodes go out unscored: the web app scores them after submission.

    ``sampling_overrides(row, rng) -> dict``, if given, adds to or replaces the
    sampling parameters of one group (benchmarks use it for long-tailed lengths).
    """

    def __init__(
        self,
        cfg: RunConfig,
        urls: Sequence[str],
        tokenizer: ChatTokenizer,
        rows: Sequence[dict[str, Any]],
        reward_fn: RewardFn | None,
        controller: StalenessController,
        sink: Sink,
        *,
        sampling_overrides: SamplingOverrides | None = None,
        poll_interval: float = 0.01,
        adapter_prefix: str | None = None,
        adapter_switch: AdapterSwitch | None = None,
        rows_used: Mapping[int, int] | None = None,
        backend: str = "torch",
    ):
        if not urls:
            raise ValueError("RolloutDriver needs at least one inference server URL")
        if not rows:
            raise ValueError("RolloutDriver needs at least one dataset row")
        for i, row in enumerate(rows):
            try:
                row_messages(row)
            except ValueError as exc:
                raise ValueError(f"dataset row {i}: {exc}") from None
        self.cfg = cfg
        self.urls = list(urls)
        self.backend = backend  # whose protocol the servers speak (client_for)
        self.tokenizer = tokenizer
        self.rows = list(rows)
        self.reward_fn = reward_fn
        self.controller = controller
        self.sink = sink
        self.sampling_overrides = sampling_overrides
        self.poll_interval = poll_interval
        # A LoRA run's adapters are named <adapter_prefix>-v<N> (rl_core.adapter_sync).
        self.adapter_prefix = adapter_prefix
        # Shared with the run's AdapterSync: a new version takes over the answers in flight.
        self.adapter_switch = adapter_switch
        self.rng = random.Random(cfg.seed)  # sampling_overrides' randomness
        self._order = prompt_order(len(self.rows), cfg.seed, rows_used)
        # Member seeds continue after the groups a resumed run already generated.
        self._groups_before = sum((rows_used or {}).values())
        self.stats: dict[str, int] = {
            "groups_started": 0,
            "groups_submitted": 0,
            "groups_failed": 0,
            "episodes_submitted": 0,
            "reward_errors": 0,
            "render_errors": 0,
        }
        self._prompts: dict[int, tuple[str, list[int]]] = {}
        self._stop = asyncio.Event()
        self._stop_requested = False
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._groups: set[asyncio.Task[None]] = set()

    # ----- control

    def stop(self) -> None:
        """Admit nothing more and cancel in-flight rollouts; ``run`` then returns. Thread-safe."""
        self._stop_requested = True
        if self._aloop is not None:
            with contextlib.suppress(RuntimeError):
                self._aloop.call_soon_threadsafe(self._stop.set)

    @property
    def in_flight_groups(self) -> int:
        return len(self._groups)

    # ----- the driver

    def _next_row(self) -> int:
        return next(self._order)

    def _prompt(self, index: int) -> tuple[str, list[int]]:
        """The rendered prompt text and its token ids (cached per row)."""
        if index not in self._prompts:
            text = self.tokenizer.render(row_messages(self.rows[index]))
            self._prompts[index] = (text, self.tokenizer.encode(text))
        return self._prompts[index]

    def sampling_params(self, row: dict[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.cfg.max_new_tokens,
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "stop_token_ids": list(self.tokenizer.eos_token_ids),
        }
        if self.sampling_overrides is not None:
            params.update(self.sampling_overrides(row, self.rng))
        return params

    async def _wait(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self.poll_interval)

    async def _admit_group(self) -> int:
        """Admit up to ``group_size`` rollouts; how many were admitted (fewer only when stopping).

        The group waits until the controller can take all of it at once, so its members
        start under the same policy version: admitting a few members now and the rest a
        version later would make the group as stale as its oldest member, and one stale
        member gets the whole group's early members dropped.
        """
        size = self.cfg.group_size
        together = min(size, self.controller.max_concurrent_rollouts or size)
        while not self._stop.is_set() and self.controller.capacity() < together:
            await self._wait()
        admitted = 0
        while admitted < size and not self._stop.is_set():
            if self.controller.try_admit():
                admitted += 1
            else:
                await self._wait()
        return admitted

    async def run(self) -> None:
        """Drive rollouts until ``stop()`` (or cancellation); in-flight ones are cancelled."""
        self._aloop = asyncio.get_running_loop()
        if self._stop_requested:
            self._stop.set()
        clients = [client_for(self.backend, url) for url in self.urls]
        group_number, render_failures = self._groups_before, 0
        try:
            while not self._stop.is_set():
                index = self._next_row()
                try:
                    prompt_text, prompt_ids = self._prompt(index)
                except Exception as exc:  # noqa: BLE001 - a row the chat template cannot render
                    self.stats["render_errors"] += 1
                    render_failures += 1
                    logger.warning("dataset row %d cannot be rendered: %s", index, exc)
                    if render_failures >= len(self.rows):
                        raise RuntimeError(
                            "no dataset row renders with the model's chat template"
                        ) from exc
                    continue
                render_failures = 0
                row = self.rows[index]
                client = clients[group_number % len(clients)]
                group_number += 1
                params = self.sampling_params(row)
                admitted = await self._admit_group()
                member_params = [
                    {**params, "sampling_seed": member_seed(self.cfg.seed, group_number, m)}
                    for m in range(admitted)
                ]
                members = [
                    asyncio.create_task(self._generate(client, prompt_ids, p))
                    for p in member_params
                ]
                self.stats["groups_started"] += 1
                task = asyncio.create_task(
                    self._finish_group(index, prompt_text, prompt_ids, member_params, members)
                )
                self._groups.add(task)
                task.add_done_callback(self._groups.discard)
        finally:
            self._stop.set()
            groups = list(self._groups)
            for task in groups:
                task.cancel()
            await asyncio.gather(*groups, return_exceptions=True)
            await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)

    async def _generate(
        self, client: InferenceClient, prompt_ids: list[int], params: dict[str, Any]
    ) -> tuple[GenerateResult, float]:
        started = time.perf_counter()
        lora_path = None
        if self.adapter_prefix is not None:  # the adapter of the current policy version
            lora_path = current_adapter(
                self.adapter_prefix,
                self.controller.version,
                lora_rank=self.cfg.lora_rank,
                init_checkpoint=self.cfg.init_checkpoint,
            )
        result = await client.generate(
            prompt_ids, params, lora_path=lora_path, switch=self.adapter_switch
        )
        return result, (time.perf_counter() - started) * 1000.0

    async def _finish_group(
        self,
        index: int,
        prompt_text: str,
        prompt_ids: list[int],
        member_params: list[dict[str, Any]],
        members: list[asyncio.Task[tuple[GenerateResult, float]]],
    ) -> None:
        accepted = False
        try:
            results = await asyncio.gather(*members, return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            if len(members) < self.cfg.group_size:  # stopped while admitting
                return
            if failures:
                self.stats["groups_failed"] += 1
                logger.warning("a rollout group failed and is not submitted: %r", failures[0])
                await asyncio.sleep(0.5)  # a server going away: don't spin
                return
            done = [r for r in results if not isinstance(r, BaseException)]
            if any(not result.output_ids for result, _ in done):
                self.stats["groups_failed"] += 1
                logger.warning("a rollout returned no tokens; its group is not submitted")
                return
            episodes = [
                self._episode(index, prompt_text, prompt_ids, params, result, latency)
                for params, (result, latency) in zip(member_params, done, strict=True)
            ]
            group_id = uuid.uuid4().hex
            for episode in episodes:
                episode.group_id = group_id
            await self.sink(episodes)
            accepted = True
            self.stats["groups_submitted"] += 1
            self.stats["episodes_submitted"] += len(episodes)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats["groups_failed"] += 1
            logger.exception("submitting a rollout group failed")
        finally:
            for task in members:
                task.cancel()
            for _ in members:
                self.controller.on_finish(accepted)

    def _episode(
        self,
        index: int,
        prompt_text: str,
        prompt_ids: list[int],
        params: dict[str, Any],
        result: GenerateResult,
        latency_ms: float,
    ) -> Episode:
        row = self.rows[index]
        completion = self.tokenizer.decode(result.output_ids)
        reward: float | None = None
        error = None
        if self.reward_fn is not None:  # else the web app scores it (judge, human)
            reward, error = score(
                self.reward_fn, prompt_text, completion, row.get("answer"), row_metadata(row)
            )
        metadata: dict[str, Any] = {"row_index": index}
        if row.get("answer") is not None:
            metadata["answer"] = row["answer"]
        if error is not None:
            self.stats["reward_errors"] += 1
            metadata["reward_error"] = error
        if result.num_segments > 1:
            metadata["num_segments"] = result.num_segments
        return Episode(
            input_ids=list(prompt_ids),
            output_ids=list(result.output_ids),
            logprobs=list(result.output_logprobs),
            versions=list(result.versions),
            reward=reward,
            finish_reason=result.finish_reason,
            text=completion,
            messages=row_messages(row),
            group_id="",
            task_id=str(row.get("id", index)),
            metadata=metadata,
            sampling=dict(params),
            latency_ms=latency_ms,
        )


def queue_sink(source: QueueSource) -> Sink:
    """The in-process adapter: a driver sink that puts each episode's trajectory on ``source``."""

    async def sink(episodes: list[Episode]) -> None:
        for episode in episodes:
            await source.put(episode.episode_id, episode.to_trajectory())

    return sink


class LocalRun:
    """A whole dataset run in one asyncio program: driver → ``QueueSource`` → ``TrainingLoop``.

    The inference servers at ``urls`` must already serve ``cfg.base_model`` at
    weight version 0 (or the checkpoint's version when resuming). Used by tests,
    benchmarks and the embedded demo; a Ray job wires the same pieces to the web
    app's internal API instead of the queue.
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        trainer: Trainer,
        urls: Sequence[str],
        rows: Sequence[dict[str, Any]],
        weights_dir: str | Path,
        checkpoint_dir: str | Path | None = None,
        reporter: Reporter | None = None,
        tokenizer: ChatTokenizer | None = None,
        reward_fn: RewardFn | None = None,
        source: QueueSource | None = None,
        sampling_overrides: SamplingOverrides | None = None,
        teacher: TeacherScorer | None = None,
    ):
        self.cfg = cfg
        resumed = latest_checkpoint(checkpoint_dir)
        self.controller = StalenessController(
            cfg.max_staleness,
            cfg.batch_size,
            cfg.max_concurrent_rollouts,
            cfg.max_queued_batches,
            version=resumed.version if resumed else 0,
        )
        self.source = source or QueueSource()
        self.weight_sync = WeightSync(urls, weights_dir, strategy=cfg.weight_sync)
        self.loop = TrainingLoop(
            cfg,
            trainer,
            self.source,
            self.weight_sync,
            reporter,
            self.controller,
            checkpoint_dir,
            teacher=teacher,
        )
        self.driver = RolloutDriver(
            cfg,
            urls,
            tokenizer or load_chat_tokenizer(str(cfg.base_model)),
            rows,
            reward_fn or load_reward_fn(cfg.reward),
            self.controller,
            queue_sink(self.source),
            sampling_overrides=sampling_overrides,
        )

    def stop(self) -> None:
        """End after the current training step, with a final checkpoint. Thread-safe."""
        self.loop.stop()

    async def run(self, max_steps: int | None = None) -> LoopSummary:
        # Restore (and push the restored weights) before any rollout starts, so admission
        # and the servers both start from the checkpoint's version.
        await self.loop.prepare()
        driver = asyncio.create_task(self.driver.run())
        loop = asyncio.create_task(self.loop.run(max_steps))
        try:
            await asyncio.wait({driver, loop}, return_when=asyncio.FIRST_COMPLETED)
            if driver.done() and not loop.done():
                driver.result()  # the driver died: raise its error
                self.loop.stop()
            return await loop
        finally:
            self.driver.stop()
            if not loop.done():
                loop.cancel()
            await asyncio.gather(driver, loop, return_exceptions=True)
            self.source.close()
            await self.weight_sync.aclose()
