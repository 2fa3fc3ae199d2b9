"""Traces (``rl_core.tracing``): when the environment turns them on, what a process exports,
and a training step's trace with a span per phase of the loop."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rl_core import tracing
from rl_core.config import RunConfig
from rl_core.loop import ListReporter, QueueSource, TrainingLoop
from rl_core.toy import TOY_SETTINGS
from rl_core.types import Trajectory

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "steep"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "TRUE"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, True),
    ],
)
def test_traces_are_requested_by_an_exporter_or_an_endpoint_unless_the_sdk_is_disabled(environ, on):
    assert tracing.requested(environ) is on


def _setup_in_a_process(env: dict[str, str]) -> tuple[list[str], str]:
    """Run ``setup("steep-test")`` and one trace in a fresh process: what it printed (the
    console exporter's spans, flushed at exit) and its stderr."""
    code = (
        "from rl_core import tracing\n"
        "print('on' if tracing.setup('steep-test', {'steep.run_id': 'r1'}) else 'off', flush=True)\n"
        "if tracing.ON:\n"
        "    t = tracing.start('steep.step', {'steep.step': 1})\n"
        "    t.begin('steep.step.train_step')\n"
        "    t.finish()\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines(), result.stderr


def _printed_spans(lines: list[str]) -> list[dict]:
    """The console exporter's spans: JSON objects, one per span, pretty-printed over lines."""
    text, spans, depth, start = "\n".join(lines), [], 0, None
    for i, char in enumerate(text):
        if char == "{":
            start = i if depth == 0 else start
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                spans.append(json.loads(text[start : i + 1]))
    return spans


def test_setup_exports_with_the_exporter_and_service_name_the_environment_names():
    lines, _ = _setup_in_a_process({"OTEL_TRACES_EXPORTER": "console"})
    assert lines[0] == "on"
    spans = _printed_spans(lines[1:])
    assert [s["name"] for s in spans] == ["steep.step.train_step", "steep.step"]
    resource = spans[0]["resource"]["attributes"]
    assert resource["service.name"] == "steep-test"  # the process's default
    assert resource["steep.run_id"] == "r1"
    assert spans[0]["parent_id"] == spans[1]["context"]["span_id"]

    lines, _ = _setup_in_a_process(
        {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "trainer-eu"}
    )
    assert _printed_spans(lines[1:])[0]["resource"]["attributes"]["service.name"] == "trainer-eu"


def test_setup_leaves_traces_off_unless_asked_or_when_the_sdk_is_disabled():
    for env in ({}, {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}):
        lines, _ = _setup_in_a_process(env)
        assert lines == ["off"]


def test_asked_for_traces_without_the_sdk_steep_warns_once_and_runs_untraced(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with caplog.at_level(logging.WARNING, logger="rl_core.tracing"):
        assert tracing.setup("steep-web") is False
    assert tracing.ON is False
    (record,) = caplog.records
    assert "not installed" in record.getMessage() and "steep[tracing]" in record.getMessage()


def test_a_trace_the_sampler_drops_is_none_so_its_phases_go_untraced():
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    try:
        tracing.use(TracerProvider(sampler=ALWAYS_OFF))
        assert tracing.ON and tracing.start("steep.turn", {"steep.request_id": "r"}) is None
        tracing.use(TracerProvider(sampler=ALWAYS_ON))
        trace = tracing.start("steep.turn", {"steep.request_id": "r"})
        assert trace is not None and trace.recording
        trace.finish()
    finally:
        tracing.use(None)


# --------------------------------------------------------------------------- a training step


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Traces on, into memory, for this test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)
    provider.shutdown()


class CountingTrainer:
    """A version per step; checkpoints as marker folders: the loop without torch."""

    version = 0

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        self.version += 1
        return {"loss": 0.5}

    def save_weights(self, path: str) -> str:
        return path

    def save_checkpoint(self, path: str) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        return path

    def load_checkpoint(self, path: str) -> None:
        raise AssertionError("nothing to resume")


def _trajectory(version: int) -> Trajectory:
    return Trajectory([1, 2, 3, 4], [0, 0, 1, 1], [0.0] * 4, [-1, -1, version, version], [1.0])


async def _train(steps: int, tmp_path: Path) -> ListReporter:
    cfg = RunConfig.from_dict(
        {"base_model": "unused", **TOY_SETTINGS, "batch_size": 2, "group_size": 1}
        | {"save_every": 2, "max_staleness": 4}
    )
    source, reporter = QueueSource(), ListReporter()
    for i in range(2 * steps):
        await source.put(f"k{i}", _trajectory(0))
    loop = TrainingLoop(cfg, CountingTrainer(), source, None, reporter, None, tmp_path)
    await loop.run(max_steps=steps)
    return reporter


async def test_each_training_step_is_a_trace_with_a_span_per_phase_in_order(spans, tmp_path):
    reporter = await _train(2, tmp_path)

    finished = spans.get_finished_spans()
    roots = sorted((s for s in finished if s.parent is None), key=lambda s: s.start_time)
    assert [r.name for r in roots] == ["steep.step", "steep.step"]
    assert len({r.context.trace_id for r in roots}) == 2  # a trace per step
    phases = ["wait_batch", "filter_stale", "train_step", "weight_sync", "report"]
    for step, root in enumerate(roots, start=1):
        children = sorted(
            (
                s
                for s in finished
                if s.parent is not None and s.parent.span_id == root.context.span_id
            ),
            key=lambda s: s.start_time,
        )
        assert all(s.context.trace_id == root.context.trace_id for s in children)
        expected = phases + (["checkpoint"] if step == 2 else [])  # save_every = 2
        assert [s.name for s in children] == [f"steep.step.{name}" for name in expected]
        for before, after in zip(children, children[1:], strict=False):
            assert before.end_time <= after.start_time  # one after another, none overlapping
        assert root.start_time <= children[0].start_time
        assert children[-1].end_time <= root.end_time
        assert root.attributes["steep.step"] == step
        assert root.attributes["steep.version"] == step
        assert root.attributes["steep.trajectories"] == 2
        assert root.attributes["steep.trained"] is True
        assert all(s.attributes["steep.step"] == step for s in children)
        # The spans are the phases the step's metrics time.
        metrics = reporter.metrics_log[step - 1][2]
        timed = {key for key in metrics if key.startswith("timing/")} - {"timing/step"}
        assert timed == {f"timing/{name}" for name in phases}


async def test_with_traces_off_a_training_step_makes_no_span(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    tracing.use(None)  # on, then off again: nothing may reach the provider
    reporter = await _train(1, tmp_path)

    assert tracing.ON is False
    assert [step for step, _, _ in reporter.metrics_log] == [1]
    assert exporter.get_finished_spans() == ()
