"""The rollout driver against a real torch engine serving the tiny model."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rl_core.chat import load_chat_tokenizer
from rl_core.config import RunConfig
from rl_core.inference.launch import free_port
from rl_core.loop import QueueSource
from rl_core.rollout import Episode, RolloutDriver, queue_sink, row_messages, row_metadata
from rl_core.staleness import StalenessController
from rl_core.toy import say_letter_reward_fn
from rl_core.types import PROMPT_VERSION, Trajectory

ROWS = [
    {"prompt": "Say b.", "answer": "b", "id": "row-b"},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say c."},
        ],
        "answer": "c",
        "metadata": {"source": "test"},
    },
]


def _cfg(model, **overrides: Any) -> RunConfig:
    settings = {
        "base_model": str(model),
        "reward": {"type": "python", "path": "rl_core.toy:say_letter_reward_fn"},
        "batch_size": 8,
        "group_size": 4,
        "max_new_tokens": 6,
        "max_staleness": 0,
        **overrides,
    }
    return RunConfig.from_dict(settings)


class Collect:
    """A sink that keeps every submitted group."""

    def __init__(self) -> None:
        self.groups: list[list[Episode]] = []

    async def __call__(self, episodes: list[Episode]) -> None:
        self.groups.append(episodes)

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g]


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _drive(driver: RolloutDriver, predicate, timeout: float = 30.0) -> None:
    task = asyncio.create_task(driver.run())
    try:
        await _until(lambda: predicate() or task.done(), timeout)
    finally:
        driver.stop()
        await asyncio.wait_for(task, 10)


def _driver(cfg, urls, rows=ROWS, reward_fn=say_letter_reward_fn, controller=None, sink=None, **kw):
    tokenizer = load_chat_tokenizer(cfg.base_model)
    controller = controller or StalenessController(
        cfg.max_staleness, cfg.batch_size, cfg.max_concurrent_rollouts
    )
    return RolloutDriver(cfg, urls, tokenizer, rows, reward_fn, controller, sink or Collect(), **kw)


# --------------------------------------------------------------------------- episodes


def test_toy_loop_and_rollout_import_neither_torch_nor_django():
    # The web demo reads rl_core.toy; the Ray job imports the loop before the trainer.
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; import rl_core.toy, rl_core.loop, rl_core.rollout; "
        "bad = [m for m in ('torch', 'transformers', 'django') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_episode_becomes_a_trajectory_with_only_generated_tokens_trained():
    episode = Episode(
        input_ids=[1, 2, 3],
        output_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        versions=[2, 3],
        reward=0.75,
        finish_reason="length",
        text="ab",
        messages=[{"role": "user", "content": "hi"}],
        group_id="g",
        task_id="7",
        metadata={"answer": "a"},
    )
    traj = episode.to_trajectory()
    assert traj.input_ids == [1, 2, 3, 4, 5]
    assert traj.loss_mask == [0, 0, 0, 1, 1]
    assert traj.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert traj.versions == [PROMPT_VERSION] * 3 + [2, 3]
    assert traj.rewards == [0.75] and traj.group_id == "g"
    assert traj.oldest_version == 2
    assert traj.metadata["finish_reason"] == "length" and traj.metadata["answer"] == "a"
    assert Trajectory.from_dict(traj.to_dict()) == traj

    data = episode.to_dict()
    for key in (
        "input_ids", "output_ids", "logprobs", "versions", "reward", "finish_reason",
        "text", "messages", "group_id", "task_id", "metadata",
    ):  # fmt: skip
        assert key in data, key
    assert data["reward"] == 0.75 and data["output_ids"] == [4, 5]


def test_rows_become_messages_and_reward_metadata():
    assert row_messages({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert row_messages(ROWS[1]) == ROWS[1]["messages"]
    assert row_metadata({"prompt": "x", "answer": "y", "metadata": {"a": 1}, "level": 3}) == {
        "a": 1,
        "level": 3,
    }
    with pytest.raises(ValueError, match="prompt"):
        row_messages({"question": "hi"})


def test_a_row_without_prompt_or_messages_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="dataset row 1"):
        _driver(_cfg(tiny_model_dir), ["http://127.0.0.1:1"], rows=[ROWS[0], {"q": "x"}])


# --------------------------------------------------------------------------- against the engine


async def test_groups_are_whole_scored_and_rendered_with_the_chat_template(
    tiny_model_dir, torch_engine
):
    cfg = _cfg(tiny_model_dir)
    sink = Collect()
    driver = _driver(cfg, [torch_engine.url], sink=sink)
    await _drive(driver, lambda: len(sink.groups) >= 2)

    tokenizer = load_chat_tokenizer(str(tiny_model_dir))
    assert len(sink.groups) == 2  # max_staleness 0: one batch of 8 = two groups of 4
    for group in sink.groups:
        assert len(group) == cfg.group_size
        assert len({e.group_id for e in group}) == 1 and group[0].group_id
        assert len({e.episode_id for e in group}) == cfg.group_size
        for episode in group:
            row = ROWS[int(episode.metadata["row_index"])]
            prompt = tokenizer.render(row_messages(row))
            assert episode.input_ids == tokenizer.encode(prompt)
            assert episode.messages == row_messages(row)
            assert 1 <= len(episode.output_ids) <= cfg.max_new_tokens
            assert len(episode.logprobs) == len(episode.versions) == len(episode.output_ids)
            assert episode.versions == [0] * len(episode.output_ids)
            assert all(lp <= 0.0 for lp in episode.logprobs)
            assert episode.text == tokenizer.decode(episode.output_ids)
            assert episode.reward == say_letter_reward_fn(
                prompt, episode.text, row["answer"], row_metadata(row)
            )
            assert episode.metadata["answer"] == row["answer"]
            assert episode.finish_reason in ("stop", "length")
            assert episode.sampling["stop_token_ids"] == tokenizer.eos_token_ids
            assert episode.sampling["max_new_tokens"] == cfg.max_new_tokens
    assert {e.task_id for e in sink.episodes} <= {"row-b", "1"}
    assert driver.stats["groups_submitted"] == 2 and driver.stats["episodes_submitted"] == 8


async def test_a_failing_reward_function_scores_zero_and_records_the_error(
    tiny_model_dir, torch_engine
):
    def broken_reward_fn(prompt, completion, answer, metadata):
        raise KeyError("no such field")

    sink = Collect()
    driver = _driver(
        _cfg(tiny_model_dir), [torch_engine.url], reward_fn=broken_reward_fn, sink=sink
    )
    await _drive(driver, lambda: len(sink.groups) >= 1)

    episode = sink.episodes[0]
    assert episode.reward == 0.0
    assert episode.metadata["reward_error"] == "KeyError: 'no such field'"
    assert driver.stats["reward_errors"] >= 4
    # A bad reward function is recorded, not fatal: the group still goes to training.
    assert driver.stats["groups_submitted"] >= 1


async def test_admission_waits_for_the_next_version_when_the_budget_is_spent(
    tiny_model_dir, torch_engine
):
    cfg = _cfg(tiny_model_dir)  # max_staleness 0, batch 8: one batch per version
    controller = StalenessController(0, 8)
    sink = Collect()
    driver = _driver(cfg, [torch_engine.url], controller=controller, sink=sink)
    task = asyncio.create_task(driver.run())
    try:
        await _until(lambda: len(sink.episodes) >= 8)
        await asyncio.sleep(0.5)
        assert len(sink.episodes) == 8, "nothing more may start before the version advances"
        assert controller.running == 0 and controller.capacity() == 0
        controller.on_version(1)
        await _until(lambda: len(sink.episodes) >= 16)
        await asyncio.sleep(0.3)
        assert len(sink.episodes) == 16
        assert all(e.versions for e in sink.episodes)
    finally:
        driver.stop()
        await asyncio.wait_for(task, 10)
    assert controller.running == 0 and controller.accepted == 16


class PeakController(StalenessController):
    """Remembers the most rollouts ever running, seen at each admission (polling could miss it)."""

    peak = 0

    def try_admit(self) -> bool:
        admitted = super().try_admit()
        self.peak = max(self.peak, self.running)
        return admitted


async def test_max_concurrent_rollouts_caps_what_is_in_flight(tiny_model_dir, torch_engine):
    cfg = _cfg(tiny_model_dir, max_staleness=4, max_concurrent_rollouts=4, max_new_tokens=16)
    controller = PeakController(4, 8, max_concurrent_rollouts=4)
    sink = Collect()
    driver = _driver(cfg, [torch_engine.url], controller=controller, sink=sink)

    await _drive(driver, lambda: len(sink.groups) >= 4)
    assert controller.peak == 4
    assert controller.running == 0


async def test_unreachable_servers_fail_groups_without_leaking_admissions(tiny_model_dir):
    dead = f"http://127.0.0.1:{free_port()}"
    controller = StalenessController(0, 8)
    sink = Collect()
    driver = _driver(_cfg(tiny_model_dir), [dead], controller=controller, sink=sink)
    await _drive(driver, lambda: driver.stats["groups_failed"] >= 2)

    assert sink.groups == []
    assert controller.running == 0 and controller.accepted == 0
    assert controller.rejected >= 8


async def test_groups_go_round_robin_over_the_servers(tiny_model_dir, torch_engine):
    dead = f"http://127.0.0.1:{free_port()}"
    sink = Collect()
    cfg = _cfg(tiny_model_dir, max_staleness=3)
    driver = _driver(cfg, [torch_engine.url, dead], sink=sink)
    calls: list[str] = []  # the server of each rollout, in the order they started
    generate = driver._generate

    async def recorded(client, prompt_ids, params):
        calls.append(client.base_url)
        return await generate(client, prompt_ids, params)

    driver._generate = recorded
    await _drive(driver, lambda: driver.stats["groups_failed"] >= 2 and len(sink.groups) >= 2)
    # Every other group goes to the dead server, all of its members together.
    size = cfg.group_size
    groups = [calls[start : start + size] for start in range(0, len(calls) - size + 1, size)]
    assert len(groups) >= 4
    assert [set(group) for group in groups] == [
        {(torch_engine.url, dead)[number % 2]} for number in range(len(groups))
    ]


async def test_sampling_overrides_apply_per_group(tiny_model_dir, torch_engine):
    sink = Collect()
    driver = _driver(
        _cfg(tiny_model_dir, max_new_tokens=32),
        [torch_engine.url],
        sink=sink,
        sampling_overrides=lambda row, rng: {"max_new_tokens": 3, "ignore_eos": True},
    )
    await _drive(driver, lambda: len(sink.groups) >= 2)
    assert all(len(e.output_ids) == 3 for e in sink.episodes)
    assert all(e.finish_reason == "length" for e in sink.episodes)


async def test_sampling_is_seeded_by_the_run_seed_distinct_per_member(tiny_model_dir, torch_engine):
    """The same seed samples the same answers; each member of a group gets its own seed."""

    async def first_groups(seed: int) -> list[list[Episode]]:
        sink = Collect()
        cfg = _cfg(tiny_model_dir, seed=seed, temperature=1.0, max_new_tokens=12)
        await _drive(_driver(cfg, [torch_engine.url], sink=sink), lambda: len(sink.groups) >= 2)
        return sorted(sink.groups[:2], key=lambda g: g[0].sampling["sampling_seed"])

    def answers(groups: list[list[Episode]]) -> list[list[int]]:
        return [e.output_ids for g in groups for e in g]

    def seeds(groups: list[list[Episode]]) -> list[int]:
        return [e.sampling["sampling_seed"] for g in groups for e in g]

    first, again, other = await first_groups(3), await first_groups(3), await first_groups(4)
    assert len(set(seeds(first))) == len(seeds(first)) == 8
    assert seeds(again) == seeds(first)
    assert answers(again) == answers(first)
    assert not set(seeds(other)) & set(seeds(first))
    assert answers(other) != answers(first)


async def test_queue_sink_feeds_the_training_source(tiny_model_dir, torch_engine):
    source = QueueSource()
    driver = _driver(_cfg(tiny_model_dir), [torch_engine.url], sink=queue_sink(source))
    await _drive(driver, lambda: source.qsize() >= 8)
    batch = await source.next_batch(8)
    assert len(batch) == 8
    assert len({key for key, _ in batch}) == 8
    groups = [t.group_id for _, t in batch]
    assert groups[:4] == [groups[0]] * 4 and groups[4:] == [groups[4]] * 4
    assert all(t.num_generated >= 1 and t.oldest_version == 0 for _, t in batch)


async def test_stop_cancels_in_flight_rollouts_and_returns(tiny_model_dir, torch_engine):
    cfg = _cfg(tiny_model_dir, max_new_tokens=2000, max_staleness=1)
    controller = StalenessController(1, 8)
    driver = _driver(
        cfg,
        [torch_engine.url],
        controller=controller,
        sampling_overrides=lambda row, rng: {"ignore_eos": True},
    )
    task = asyncio.create_task(driver.run())
    await _until(lambda: controller.running == 16)
    driver.stop()
    await asyncio.wait_for(task, 10)
    assert controller.running == 0 and controller.accepted == 0


async def test_without_a_reward_function_episodes_go_out_unscored_for_the_web_app(
    tiny_model_dir, torch_engine
):
    judged = {"type": "judge", "rubric": "r", "base_url": "http://judge/v1", "model": "m"}
    sink = Collect()
    driver = _driver(
        _cfg(tiny_model_dir, reward=judged), [torch_engine.url], reward_fn=None, sink=sink
    )
    await _drive(driver, lambda: len(sink.groups) >= 1)

    episode = sink.episodes[0]
    assert episode.reward is None and "reward_error" not in episode.metadata
    assert episode.to_dict()["reward"] is None  # what the job submits: the web app judges it
    with pytest.raises(ValueError, match="given by the web app"):
        episode.to_trajectory()  # never trained without its reward
