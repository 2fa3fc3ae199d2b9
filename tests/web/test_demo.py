"""``./steep up``'s demo: two runs, the demo pool the online one attaches to, the demo agent on it, and what the README's
walkthrough reads from ``DATA_DIR/demo.env``; the built-in demo agent's guards."""

from __future__ import annotations

import fcntl
import io
import re
import stat

import pytest
from django.core.management import call_command

from rl_core.toy import DEMO_SETTINGS, ONLINE_DEMO_SETTINGS
from webapp.accounts.models import APIKey
from webapp.accounts.services import api_key_authenticate
from webapp.agents.models import Agent
from webapp.pools.models import Pool
from webapp.runs.demo import (
    DEMO_AGENT,
    DEMO_AGENT_KEY_NAME,
    DEMO_KEY_NAME,
    DEMO_ONLINE_RUN,
    DEMO_POOL,
    DEMO_RUN,
    demo_agent_credentials,
    demo_bootstrap,
)
from webapp.runs.demo_agent import demo_agent_play
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db

S = Run.Status


@pytest.fixture
def data_dir(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    return tmp_path


def env_file(data_dir) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(.*)$", (data_dir / "demo.env").read_text(), re.M))


def test_the_demo_has_a_dataset_run_and_an_online_run_with_the_demo_agent(data_dir):
    demo = demo_bootstrap(model="/models/tiny")

    dataset_run = Run.objects.get(pk=demo.run_id)
    online = Run.objects.get(pk=demo.online_run_id)
    assert (dataset_run.name, dataset_run.mode, dataset_run.status) == (
        DEMO_RUN,
        "dataset",
        S.DRAFT,
    )
    assert dataset_run.dataset.row_count == 512
    assert {k: dataset_run.config[k] for k in DEMO_SETTINGS} == DEMO_SETTINGS
    assert (online.name, online.mode, online.base_model) == (
        DEMO_ONLINE_RUN,
        "online",
        "/models/tiny",
    )
    assert {k: online.config[k] for k in ONLINE_DEMO_SETTINGS} == ONLINE_DEMO_SETTINGS
    agent = Agent.objects.get(project=online.project, name=DEMO_AGENT)
    assert agent.run == online and demo.agent_base_url == agent.base_url


def test_demo_env_holds_the_walkthroughs_variables_privately(data_dir, settings):
    demo = demo_bootstrap(model="/models/tiny")
    variables = env_file(data_dir)
    assert variables == {
        "STEEP_URL": settings.SITE_URL,
        "STEEP_KEY": demo.api_key,
        "STEEP_BASE_URL": demo.agent_base_url,
        "STEEP_RUN": demo.online_run_id,
    }
    assert str(api_key_authenticate(plaintext=demo.api_key).project_id) == demo.project_id
    for name in ("demo.env", "demo-agent.key", "admin-password.txt"):
        assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600, name


def test_bootstrap_again_keeps_the_key_the_runs_and_the_agents_key(data_dir):
    # An agent configured with the printed key keeps working after ./steep up restarts.
    first = demo_bootstrap(model="/models/tiny")
    agent_key = (data_dir / "demo-agent.key").read_text()
    second = demo_bootstrap(model="/models/tiny")

    assert (second.run_id, second.online_run_id) == (first.run_id, first.online_run_id)
    assert second.api_key == first.api_key == env_file(data_dir)["STEEP_KEY"]
    assert api_key_authenticate(plaintext=first.api_key).name == DEMO_KEY_NAME
    assert (data_dir / "demo-agent.key").read_text() == agent_key
    assert APIKey.objects.filter(name=DEMO_KEY_NAME, revoked_at__isnull=True).count() == 1
    assert APIKey.objects.filter(name=DEMO_AGENT_KEY_NAME, revoked_at__isnull=True).count() == 1
    assert Run.objects.count() == 2


def test_a_revoked_demo_key_is_replaced_and_demo_env_holds_the_new_one(data_dir):
    first = demo_bootstrap(model="/models/tiny")
    APIKey.objects.get(name=DEMO_KEY_NAME).revoke()
    second = demo_bootstrap(model="/models/tiny")

    assert second.api_key != first.api_key
    assert env_file(data_dir)["STEEP_KEY"] == second.api_key
    assert api_key_authenticate(plaintext=second.api_key).name == DEMO_KEY_NAME


def test_a_key_in_demo_env_that_is_not_the_demo_key_is_not_kept(data_dir, api_key):
    # Only the demo project's demo key is kept, not another project's written there.
    first = demo_bootstrap(model="/models/tiny")
    env = (data_dir / "demo.env").read_text().replace(first.api_key, api_key)
    (data_dir / "demo.env").write_text(env)
    second = demo_bootstrap(model="/models/tiny")

    assert second.api_key not in (first.api_key, api_key)
    assert api_key_authenticate(plaintext=first.api_key) is None  # revoked: replaced
    assert str(api_key_authenticate(plaintext=second.api_key).project_id) == second.project_id


def test_a_revoked_demo_agent_key_is_replaced(data_dir):
    demo_bootstrap(model="/models/tiny")
    APIKey.objects.get(name=DEMO_AGENT_KEY_NAME).revoke()
    demo_bootstrap(model="/models/tiny")
    key = (data_dir / "demo-agent.key").read_text().strip()
    assert api_key_authenticate(plaintext=key).name == DEMO_AGENT_KEY_NAME


def test_start_queues_both_runs_and_resumes_stopped_ones_but_not_a_completed_dataset_run(
    data_dir, set_status
):
    demo = demo_bootstrap(model="/models/tiny", start=True)
    assert Run.objects.get(pk=demo.run_id).status == S.QUEUED
    assert Run.objects.get(pk=demo.online_run_id).status == S.QUEUED

    set_status(Run.objects.get(pk=demo.run_id), S.COMPLETED)
    set_status(Run.objects.get(pk=demo.online_run_id), S.STOPPED)
    again = demo_bootstrap(model="/models/tiny", start=True)
    assert Run.objects.get(pk=demo.run_id).status == S.COMPLETED  # its curve stays to look at
    assert again.online_run_id == demo.online_run_id
    assert Run.objects.get(pk=demo.online_run_id).status == S.QUEUED


def test_a_completed_online_run_is_run_again_and_the_demo_agent_moves_to_it(data_dir, set_status):
    demo = demo_bootstrap(model="/models/tiny")
    set_status(Run.objects.get(pk=demo.online_run_id), S.COMPLETED)
    again = demo_bootstrap(model="/models/tiny", start=True)

    assert again.online_run_id != demo.online_run_id
    online = Run.objects.get(pk=again.online_run_id)
    assert (online.name, online.status) == (DEMO_ONLINE_RUN, S.QUEUED)
    assert Agent.objects.get(name=DEMO_AGENT).run == online
    assert env_file(data_dir)["STEEP_RUN"] == again.online_run_id


def test_an_older_demo_agent_on_another_run_is_moved_to_the_online_run(
    data_dir, make_run, make_agent
):
    demo = demo_bootstrap(model="/models/tiny")
    agent = Agent.objects.get(name=DEMO_AGENT)
    old = make_run(agent.project, name="demo: an older demo run")
    agent.run = old
    agent.save(update_fields=["run"])
    demo_bootstrap(model="/models/tiny")
    assert Agent.objects.get(pk=agent.pk).run_id == Run.objects.get(pk=demo.online_run_id).id


def test_the_command_prints_the_login_the_key_and_where_the_walkthrough_starts(data_dir):
    out = io.StringIO()
    call_command("bootstrap_demo", "--model", "/models/tiny", stdout=out)
    printed = out.getvalue()
    variables = env_file(data_dir)
    assert variables["STEEP_KEY"] in printed and variables["STEEP_BASE_URL"] in printed
    assert (data_dir / "admin-password.txt").read_text().strip() in printed
    assert f"saved in {data_dir}/admin-password.txt" in printed
    assert f"saved in {data_dir}/demo.env" in printed  # the key's line
    assert f"source {data_dir}/demo.env" in printed


# --- the built-in demo agent ----------------------------------------------------------------


def test_the_demo_agent_plays_only_while_the_online_run_is_running(data_dir, set_status, settings):
    assert demo_agent_credentials() is None  # no demo at all
    demo = demo_bootstrap(model="/models/tiny")
    assert demo_agent_credentials() is None  # a draft
    assert demo_agent_play()["idle"] == "no running online demo run"

    set_status(Run.objects.get(pk=demo.online_run_id), S.RUNNING)
    url, key = demo_agent_credentials()
    agent = Agent.objects.get(name=DEMO_AGENT)
    assert url == f"{settings.INTERNAL_API_URL}/agents/{agent.id}/v1"
    assert api_key_authenticate(plaintext=key).name == DEMO_AGENT_KEY_NAME


def test_the_demo_agent_can_be_turned_off(data_dir, settings):
    settings.STEEP_DEMO_AGENT = False
    assert demo_agent_play() == {"played": 0, "idle": "STEEP_DEMO_AGENT is off"}


def test_one_demo_agent_tick_at_a_time(data_dir):
    with open(data_dir / "demo-agent.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another tick is playing
        assert demo_agent_play()["idle"] == "another tick is playing"
    assert demo_agent_play()["idle"] == "no running online demo run"  # released


def test_the_demo_agent_is_on_the_beat_schedule_unless_turned_off():
    import os
    import subprocess
    import sys

    code = "from django.conf import settings; print('demo-agent' in settings.CELERY_BEAT_SCHEDULE)"

    def scheduled(value: str) -> str:
        env = dict(os.environ, DJANGO_SETTINGS_MODULE="webapp.settings", STEEP_DEMO_AGENT=value)
        return subprocess.run(
            [sys.executable, "-c", f"import django; django.setup(); {code}"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    assert scheduled("true") == "True"
    assert scheduled("false") == "False"


def test_the_demo_has_a_cpu_pool_of_the_demo_model_and_the_online_run_attaches_to_it(data_dir):
    demo = demo_bootstrap(model="/models/tiny")
    pool = Pool.objects.get(name=DEMO_POOL)
    assert (pool.base_model, pool.backend, pool.replicas, pool.status) == (
        "/models/tiny",
        "torch",
        1,
        "stopped",
    )
    online = Run.objects.get(pk=demo.online_run_id)
    assert (online.config["inference_pool"], online.config["lora_rank"]) == (DEMO_POOL, 8)
    # The dataset run, whose curve the README shows, stays full-weight on servers of its own.
    assert Run.objects.get(pk=demo.run_id).config["inference_pool"] == ""


def test_start_starts_the_demo_pool_once_and_leaves_an_interrupted_one_to_the_worker(data_dir):
    demo_bootstrap(model="/models/tiny", start=True)
    assert Pool.objects.get(name=DEMO_POOL).status == "starting"
    demo_bootstrap(model="/models/tiny", start=True)  # already starting: nothing to do
    Pool.objects.filter(name=DEMO_POOL).update(status="interrupted")
    demo_bootstrap(model="/models/tiny", start=True)
    assert Pool.objects.get(name=DEMO_POOL).status == "interrupted"  # pools_resume starts it
    assert Pool.objects.count() == 1


def test_an_online_run_from_before_the_pool_stays_full_weight(data_dir):
    first = demo_bootstrap(model="/models/tiny")
    online = Run.objects.get(pk=first.online_run_id)
    full_weight = {**online.config, "lora_rank": 0, "inference_pool": ""}
    Run.objects.filter(pk=online.pk).update(config=full_weight)  # as an older Steep made it
    again = demo_bootstrap(model="/models/tiny", start=True)
    assert again.online_run_id == first.online_run_id
    assert Run.objects.get(pk=online.pk).config == full_weight
