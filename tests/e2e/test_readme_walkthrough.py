"""The README's walkthrough, run as printed against a stack started as ``./steep up`` starts it.

Every fenced block of the "Five-minute walkthrough" section runs, in order, unedited:
bash blocks in one bash (``set -e``: any failing command fails the test), each python block
saved to a file and run with this interpreter, as the README tells the reader. The only
inputs are what ``./steep up`` leaves for the reader: ``data/demo.env`` (the blocks run in a
folder whose ``data`` is the stack's DATA_DIR). A change to the README that breaks the
walkthrough fails here.

The stack is ``./steep up``'s: ``prepare`` (migrate, build the tiny model,
``bootstrap_demo --start``), then a Celery worker with beat and the web server, on their own
DATA_DIR and port, sharing the test database.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.e2e.conftest import dashboard_login, dashboard_post, demo_env, steep_up_stack
from tests.livestack import ROOT, wait_for

SECTION = "## Five-minute walkthrough"
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)


def walkthrough_blocks(readme: str) -> list[tuple[str, str, int]]:
    """(language, code, line number) of each fenced block in the walkthrough section."""
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start : end if end != -1 else None]
    first_line = readme[:start].count("\n") + 1
    return [
        (m["lang"], textwrap.dedent(m["body"]), first_line + section[: m.start()].count("\n"))
        for m in FENCE.finditer(section)
    ]


def test_the_walkthrough_blocks_are_found():
    blocks = walkthrough_blocks((ROOT / "README.md").read_text())
    languages = [lang for lang, _, _ in blocks]
    assert "bash" in languages and "python" in languages, languages
    assert set(languages) <= {"bash", "python"}, f"a block this test cannot run: {languages}"
    python = next(code for lang, code, _ in blocks if lang == "python")
    assert "raise_for_status()" in python


def walkthrough_script(blocks: list[tuple[str, str, int]], folder: Path) -> str:
    """One bash script: the bash blocks as they are, each python block run from its file."""
    lines = ["set -e", "trap 'echo \"### failed in block $BLOCK\" >&2' ERR"]
    for number, (lang, code, line) in enumerate(blocks, 1):
        lines.append(f"BLOCK='{number} ({lang}, README.md line {line})'; echo \"### block $BLOCK\"")
        if lang == "bash":
            lines.append(code)
        else:
            script = folder / f"block{number}.py"
            script.write_text(code)
            lines.append(f'"$WALKTHROUGH_PYTHON" {script.name}')
        lines.append(f'echo "### block {number} ok"')
    return "\n".join(lines) + "\n"


@pytest.fixture
def steep_up(transactional_db, tmp_path_factory):
    """./steep up: its prepare() (migrate, the tiny model, bootstrap_demo --start), then its
    worker and web server; (the stack, its DATA_DIR, what prepare printed)."""
    with steep_up_stack(tmp_path_factory) as started:
        yield started


@pytest.mark.slow
def test_the_walkthrough_runs_as_printed_then_a_second_project_trains_on_the_demo_pool(
    steep_up, tmp_path
):
    """One ``./steep up`` for both (each start costs a minute of the suite): the README's
    walkthrough as printed, then a second project's LoRA run beside the online demo run."""
    walkthrough_runs_as_printed(steep_up, tmp_path)
    second_projects_lora_run_trains_on_the_demo_pool(steep_up)


def walkthrough_runs_as_printed(steep_up, tmp_path) -> None:
    from webapp.gateway.models import Session
    from webapp.runs.models import Run

    stack, data_dir, printed = steep_up
    variables = demo_env(data_dir)
    assert f"source {data_dir}/demo.env" in printed
    assert set(variables) == {"STEEP_URL", "STEEP_KEY", "STEEP_BASE_URL", "STEEP_RUN"}
    assert variables["STEEP_KEY"] in printed  # the key printed is the one saved

    blocks = walkthrough_blocks((ROOT / "README.md").read_text())
    (tmp_path / "data").symlink_to(data_dir)  # the reader's ./data
    script = walkthrough_script(blocks, tmp_path)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "WALKTHROUGH_PYTHON": sys.executable,
    }
    try:
        result = subprocess.run(
            ["bash", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the walkthrough hung:\n{exc.stdout}\n{exc.stderr}\n{stack.log_tail()}")
    report = f"{result.stdout}\n{result.stderr}\n{stack.log_tail()}"
    assert result.returncode == 0, report
    for number in range(1, len(blocks) + 1):
        assert f"### block {number} ok" in result.stdout, report

    # The reader's episode reached the online demo run, rewarded and ready for training.
    run = Run.objects.get(pk=variables["STEEP_RUN"])
    assert run.mode == "online"
    sessions = list(Session.objects.filter(run=run))
    readers = [s for s in sessions if s.metadata.get("agent") != "built-in demo agent"]
    assert [s.status for s in readers] == ["ended"], report
    assert readers[0].trajectory in ("ready", "claimed", "trained")

    # Meanwhile the built-in demo agent keeps the online run training.
    wait_for(
        lambda: Run.objects.get(pk=run.pk).step >= 2,
        300,
        f"two training steps of the online demo run\n{stack.log_tail()}",
        interval=2,
    )
    played = [
        s
        for s in Session.objects.filter(run=run)
        if s.metadata.get("agent") == "built-in demo agent"
    ]
    assert sum(s.trajectory == "trained" for s in played) >= 8, stack.log_tail()
    assert Run.objects.get(pk=run.pk).status == "running"


def second_projects_lora_run_trains_on_the_demo_pool(steep_up) -> None:
    """Issue 17 item 5: a second project's LoRA run, started from the dashboard, trains
    beside the online demo run on the demo pool's one engine."""
    import json

    from rl_core.toy import DEMO_REWARD, demo_rows
    from tests.web.test_dashboard_forms import browser_defaults
    from webapp.accounts.models import Project
    from webapp.datasets.models import Dataset
    from webapp.gateway.models import InferenceServer
    from webapp.pools.models import Pool, PoolServer
    from webapp.runs.models import MetricPoint, Run

    stack, data_dir, _ = steep_up
    demo = demo_env(data_dir)
    browser = dashboard_login(demo["STEEP_URL"], data_dir)
    demo_project = Run.objects.get(pk=demo["STEEP_RUN"]).project
    # The demo's dataset run is not part of this: its cores go to the two runs on the pool.
    dataset_run = Run.objects.get(project=demo_project, mode="dataset")
    stopped = dashboard_post(
        browser, f"/projects/{demo_project.id}/runs/{dataset_run.id}/stop/", {}
    )
    assert stopped.status_code == 302

    assert dashboard_post(browser, "/projects/", {"name": "second"}).status_code == 302
    project = Project.objects.get(name="second")
    rows = "".join(json.dumps(row) + "\n" for row in demo_rows(64)).encode()
    files = {"file": ("letters.jsonl", rows, "application/jsonl")}
    uploaded = dashboard_post(
        browser, f"/projects/{project.id}/datasets/", {"name": "l"}, files=files
    )
    assert uploaded.status_code == 302, uploaded.text
    dataset = Dataset.objects.get(project=project)
    form = browser_defaults(
        name="second: a LoRA run on the demo pool",
        mode="dataset",
        dataset=str(dataset.id),
        base_model=str(data_dir / "models" / "tiny-chat"),
        reward=json.dumps(DEMO_REWARD),
        lora_rank="8",
        lora_alpha="16",
        learning_rate="0.02",
        inference_pool="demo",
        batch_size="8",
        group_size="4",
        max_new_tokens="4",
    )
    created = dashboard_post(browser, f"/projects/{project.id}/runs/new/", form)
    assert created.status_code == 302, created.text
    second = Run.objects.get(project=project)
    assert (
        dashboard_post(browser, f"/projects/{project.id}/runs/{second.id}/start/", {}).status_code
        == 302
    )

    online = Run.objects.get(pk=demo["STEEP_RUN"])
    start = online.step
    wait_for(
        lambda: (
            Run.objects.get(pk=second.pk).step >= 2
            and Run.objects.get(pk=online.pk).step >= start + 2
        ),
        420,
        f"two steps of each run on the demo pool\n{stack.log_tail()}",
        interval=2,
    )
    pool = Pool.objects.get(name="demo")
    (server,) = PoolServer.objects.filter(pool=pool).values_list("url", flat=True)
    for run in (online, second):  # one engine process serves both runs' adapters
        urls = set(InferenceServer.objects.filter(run=run).values_list("url", flat=True))
        assert urls == {server}, (run.name, urls, server)
        assert Run.objects.get(pk=run.pk).status == "running"
    # The dataset run's rollout driver has its answers in flight moved onto each new adapter
    # (AdapterSwitch: each push reports how many moved); the gateway's requests are not moved.
    moved = MetricPoint.objects.filter(name="weight_sync/requests_moved")
    assert moved.filter(run=second).exists() and not moved.filter(run=online).exists()
