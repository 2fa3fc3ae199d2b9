"""``./steep up`` keeps the terminal for people (issue 39), and its demo key across restarts.

With the demo running (its pool, both runs, the built-in demo agent), ``./steep up`` runs until
the demo has done what it does in its first two minutes (some 2,000 requests: the agent's
episodes and the runs' internal API) and a person has opened the dashboard; its terminal must
then hold fewer than 100 lines: the runs' and pools' status lines and the banner, which comes
last at readiness and says where the password, the key and ``demo.env`` are; no warning. Every
request line is in ``DATA_DIR/logs/web.log`` instead. After Ctrl-C and a second start, the key
an agent was given still authenticates, and ``demo.env`` holds it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess

import pytest

from tests.e2e.conftest import demo_env
from tests.e2e.test_steep_up import DIRECT, Steep, installed, started, steeps_processes
from tests.livestack import free_port, wait_for
from workers.ray_cluster import _ray_temp_dir, stop_local_cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not installed() and not os.environ.get("CI"), reason="needs ./steep install"
    ),
    # Two starts; the first runs ~2,000 requests of the demo (2 minutes on a quiet 2-core machine).
    pytest.mark.timeout(900),
]

# What the demo's first two minutes log in web.log (measured: ~2,000 lines in 150 s).
TWO_MINUTES_OF_REQUESTS = 1500
READY = "Ctrl-C stops everything"


def test_steep_up_prints_under_100_lines_over_the_demos_first_two_minutes(tmp_path):
    steep = Steep(tmp_path / "data", free_port(), tmp_path)
    for name in ("STEEP_DEMO_AGENT", "STEEP_DEMO_START", "LOG_CONSOLE", "LOG_FILE"):
        steep.env.pop(name, None)  # the demo as a new user gets it: started, its agent playing
    seen: dict[int, int | None] = {}
    try:
        steep.start(0)
        wait_for(lambda: steep.check_up() or READY in steep.output(), 300, "the banner")
        key = steep.api_key()
        wait_for(
            lambda: _requests_logged(steep) >= TWO_MINUTES_OF_REQUESTS, 600, "the demo's requests"
        )
        for path in ("/login/", "/static/steep.css", "/static/steep.js"):  # a person looks
            with DIRECT.open(f"{steep.url}{path}", timeout=30) as response:
                assert response.status == 200
        seen |= steeps_processes(steep)
        _stop(steep)

        printed = steep.output().splitlines()
        assert len(printed) < 100, "\n".join(printed)
        assert not re.search(r"warn|traceback", steep.output(), re.I), steep.output()
        # The banner comes last at readiness: after it, only status lines until the stop.
        ready = next(i for i, line in enumerate(printed) if READY in line)
        stopping = next(
            i for i, line in enumerate(printed) if line.endswith("[steep]\033[0m stopping")
        )
        assert all("steep.status" in line for line in printed[ready + 1 : stopping]), printed
        banner = "\n".join(printed[:ready])
        data_dir = steep.data_dir
        assert f"saved in {data_dir}/admin-password.txt" in banner
        assert f"{key}   (kept across restarts; saved in {data_dir}/demo.env)" in banner
        assert f"source {data_dir}/demo.env" in banner
        assert any("run 'demo: online run (agents welcome)': running" in line for line in printed)

        steep.start(1)  # an agent configured with the key keeps working
        wait_for(lambda: steep.check_up() or READY in steep.output(), 300, "the second banner")
        assert steep.api_key() == key == demo_env(data_dir)["STEEP_KEY"]
        runs = steep.rest("GET", "/runs/")  # as the key, which still authenticates
        assert {run["name"] for run in runs["results"]} >= {"demo: online run (agents welcome)"}
        seen |= steeps_processes(steep)
        _stop(steep)
    finally:  # after a failure: whatever is left of it, by PID
        if steep.process is not None and steep.process.poll() is None:
            seen |= steeps_processes(steep)
            os.killpg(steep.process.pid, signal.SIGKILL)
            steep.process.wait(timeout=10)
        stop_local_cluster(data_dir=steep.data_dir)
        for pid, start in seen.items():
            if start is not None and started(pid) == start:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(_ray_temp_dir(steep.data_dir), ignore_errors=True)


def _requests_logged(steep: Steep) -> int:
    steep.check_up()
    log = steep.data_dir / "logs" / "web.log"
    return log.read_text().count(" steep.request ") if log.exists() else 0


def _stop(steep: Steep) -> None:
    os.killpg(steep.process.pid, signal.SIGINT)  # Ctrl-C
    try:
        steep.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"./steep up still running 30 s after Ctrl-C:\n{steep.output()}")
