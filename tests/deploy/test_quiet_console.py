"""``LOG_CONSOLE=quiet`` with a ``LOG_FILE``, as ``./steep up`` runs its web server and worker:
the terminal gets warnings, errors and the runs' and pools' status lines; every record, the
line per request, per Celery task and per demo episode included, goes to the file. And the
worker says nothing about running as root.

Each case runs in a fresh interpreter (settings are read at import time) and logs what the
demo's first two minutes log, in kind and in number (measured: ~2,000 request lines, ~700
worker lines); the slow test of ``./steep up`` itself is ``tests/e2e/test_steep_up_terminal.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.livestack import ROOT

TWO_MINUTES_OF_THE_DEMO = """
import logging, time
from webapp.observability import log_request, log_status

log_status("run", "demo", "queued", "Start requested.")
for _ in range(2000):
    log_request("POST", "/agents/a/v1/chat/completions", 200, time.perf_counter())
    log_request("POST", "/internal/v1/runs/r/claim", 200, time.perf_counter())
for _ in range(100):
    logging.getLogger("celery.worker.strategy").info("Task demo_agent_tick[1] received")
    logging.getLogger("celery.app.trace").info("Task demo_agent_tick[1] succeeded")
    logging.getLogger("httpx").info("HTTP Request: POST http://x/v1/chat/completions 200")
    logging.getLogger("webapp.runs.demo_agent").info("demo agent: backing off (429)")
log_status("run", "demo", "running", "First inference server is healthy.")
log_status("run", "demo", "failed", "the trainer ran out of memory")
logging.getLogger("django.request").warning("Not Found: /nowhere")
logging.getLogger("steep.test").error("an error")
"""

# Celery's worker sets logging up after Django did (its Django fix-up); then, as above.
AS_THE_WORKER = (
    "from workers.celery import app\n"
    "app.log.setup_logging_subsystem(loglevel='INFO')\n" + TWO_MINUTES_OF_THE_DEMO
)

ON_THE_TERMINAL = [
    "steep.status [-] run 'demo': queued (Start requested.)",
    "steep.status [-] run 'demo': running (First inference server is healthy.)",
    "WARNING steep.status [-] run 'demo': failed (the trainer ran out of memory)",
    "WARNING django.request [-] Not Found: /nowhere",
    "ERROR steep.test [-] an error",
]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import django\ndjango.setup()\n" + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("process", ["web", "worker"])
def test_the_quiet_console_shows_status_lines_and_warnings_and_the_file_has_every_line(
    tmp_path, production_env, process
):
    log_file = tmp_path / "logs" / f"{process}.log"
    env = production_env(tmp_path, LOG_CONSOLE="quiet", LOG_FILE=str(log_file))
    result = _run(AS_THE_WORKER if process == "worker" else TWO_MINUTES_OF_THE_DEMO, env)
    assert result.returncode == 0, result.stderr

    printed = result.stderr.splitlines() + result.stdout.splitlines()
    assert len(printed) == len(ON_THE_TERMINAL), printed[:20]
    for line, expected in zip(printed, ON_THE_TERMINAL, strict=True):
        assert line.endswith(expected), (line, expected)
    kept = log_file.read_text().splitlines()
    assert len(kept) == 4000 + 400 + len(ON_THE_TERMINAL)
    assert sum("steep.request" in line for line in kept) == 4000


def test_the_console_shows_everything_by_default(tmp_path, production_env):
    result = _run(TWO_MINUTES_OF_THE_DEMO, production_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert len(result.stderr.splitlines()) == 4000 + 400 + len(ON_THE_TERMINAL)
    assert not (tmp_path / "logs").exists()


def test_the_log_file_is_json_lines_with_log_format_json(tmp_path, production_env):
    log_file = tmp_path / "web.log"
    env = production_env(tmp_path, LOG_CONSOLE="quiet", LOG_FILE=str(log_file), LOG_FORMAT="json")
    assert _run(TWO_MINUTES_OF_THE_DEMO, env).returncode == 0
    first = json.loads(log_file.read_text().splitlines()[0])
    assert (first["logger"], first["message"]) == (
        "steep.status",
        "run 'demo': queued (Start requested.)",
    )


def test_an_unknown_console_mode_names_the_ones_there_are(tmp_path, production_env):
    result = _run("", production_env(tmp_path, LOG_CONSOLE="silent"))
    assert result.returncode != 0
    assert "LOG_CONSOLE='silent' is not a console mode; use all" in result.stderr


def test_the_worker_does_not_warn_about_running_as_root():
    # As root, whoever runs the tests: Celery warns then, unless the app module says it need
    # not (Steep's worker accepts JSON only, so the pickle risk it warns of is not there).
    code = """
import os, warnings
from celery import platforms
os.getuid = os.geteuid = lambda: 0

def warned():
    with warnings.catch_warnings(record=True) as caught:
        platforms.check_privileges(["json"])
    return [str(w.message).splitlines()[0] for w in caught]

before = warned()
import workers.celery  # what `celery -A workers` loads
print(before, warned())
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.strip().split("] [")
    assert "superuser privileges" in before  # the check does warn as root
    assert after == "]"
