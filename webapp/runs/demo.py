"""The demo that ``./steep up`` sets up, so that the README's walkthrough works as printed.

In the ``demo`` project: an admin user, an API key (printed, and written with the URLs the
walkthrough needs to ``DATA_DIR/demo.env``; kept across restarts while it works, so an agent
configured with it keeps working), and two runs on the demo model.
Beside them, the platform's ``demo`` inference pool: one torch-engine server of the demo
model that LoRA runs of any project may attach to (``inference_pool: demo``).

* a dataset run that learns the demo task of ``rl_core.toy`` (reading which letter a
  prompt asks for) visibly over a few minutes;
* an online run that stays running, with the ``demo agent`` bound to it: a LoRA run
  attached to the ``demo`` pool (one created before the pool existed stays full-weight,
  with servers of its own). The built-in demo agent (``webapp.runs.demo_agent``) plays episodes on it through the gateway, with a key
  of its own (``DATA_DIR/demo-agent.key``), so its charts move; the walkthrough's agent
  joins it.
"""

from __future__ import annotations

import io
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from rl_core.config import RunConfig
from rl_core.toy import DEMO_SETTINGS, ONLINE_DEMO_SETTINGS, demo_rows
from webapp.accounts.models import APIKey, Project
from webapp.accounts.services import (
    api_key_authenticate,
    api_key_create,
    bootstrap_project,
    user_get_or_create,
)
from webapp.agents.models import Agent
from webapp.agents.services import agent_bind_run, agent_create
from webapp.datasets.models import Dataset
from webapp.datasets.services import dataset_create
from webapp.pools.models import Pool
from webapp.pools.services import pool_create, pool_start
from webapp.runs.models import Run
from webapp.runs.services import TRANSITIONS, run_clone, run_create, run_start

DEMO_PROJECT = "demo"
DEMO_KEY_NAME = "steep up demo key"
DEMO_AGENT_KEY_NAME = "built-in demo agent"
DEMO_DATASET = "say-the-letter"
DEMO_RUN = "demo: learn to say the letter asked for"
DEMO_ONLINE_RUN = "demo: online run (agents welcome)"
DEMO_AGENT = "demo agent"
DEMO_POOL = "demo"


@dataclass
class Demo:
    username: str
    password: str | None
    project_id: str
    api_key: str
    run_id: str  # the dataset run
    online_run_id: str
    agent_base_url: str  # the demo agent's, bound to the online run
    env_file: Path  # the walkthrough's variables


def _private_file(name: str) -> Path:
    return Path(settings.DATA_DIR) / name


def _write_private(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


def _admin_password() -> tuple[str, bool]:
    path = _private_file("admin-password.txt")
    if path.exists():
        return path.read_text().strip(), False
    password = secrets.token_urlsafe(12)
    _write_private(path, password + "\n")
    return password, True


def _startable(run: Run) -> bool:
    return Run.Status.QUEUED in TRANSITIONS.get(run.status, set())


def _dataset(project: Project, user) -> Dataset:
    dataset = Dataset.objects.filter(project=project, name=DEMO_DATASET).first()
    if dataset is None:
        body = "".join(json.dumps(row) + "\n" for row in demo_rows(512)).encode()
        dataset = dataset_create(
            project=project, name=DEMO_DATASET, file=io.BytesIO(body), user=user
        )
    return dataset


def _dataset_run(project: Project, model: str, dataset: Dataset) -> Run:
    run = Run.objects.filter(project=project, name=DEMO_RUN).first()
    if run is None:
        config = RunConfig.from_dict({"mode": "dataset", "base_model": model, **DEMO_SETTINGS})
        # The operator named the demo's model (bootstrap_demo --model), and its rewards are
        # Steep's own: taken as they are, past the rules a tenant's runs are held to.
        run = run_create(
            project=project, name=DEMO_RUN, config=config, dataset=dataset, unrestricted=True
        )
    return run


def _demo_pool(model: str) -> Pool:
    """The shared CPU pool of the demo model; a stopped one follows a changed demo model."""
    pool = Pool.objects.filter(name=DEMO_POOL).first()
    if pool is None:
        return pool_create(
            name=DEMO_POOL,
            base_model=model,
            backend=Pool.Backend.TORCH,
            replicas=1,
            start=False,
            unrestricted=True,
        )
    if pool.base_model != model and pool.status in (Pool.Status.STOPPED, Pool.Status.FAILED):
        pool.base_model = model
        pool.save(update_fields=["base_model", "updated_at"])
    return pool


def _online_run(project: Project, model: str) -> Run:
    """The newest online demo run; a new one when it has completed (completed is final)."""
    run = Run.objects.filter(project=project, name=DEMO_ONLINE_RUN).order_by("-created_at").first()
    if run is None:
        config = RunConfig.from_dict(
            {
                "mode": "online",
                "base_model": model,
                **ONLINE_DEMO_SETTINGS,
                "inference_pool": DEMO_POOL,
            }
        )
        run = run_create(project=project, name=DEMO_ONLINE_RUN, config=config, unrestricted=True)
    elif run.status == Run.Status.COMPLETED:
        run = run_clone(run=run, name=DEMO_ONLINE_RUN)
    return run


def _kept_key(project: Project, user, *, name: str, saved: str | None) -> str:
    """``saved`` (a key's plaintext, as a file kept it) while it still works for ``project``;
    else a new key named ``name``, the project's others of that name revoked."""
    if saved:
        key = api_key_authenticate(plaintext=saved)
        if key is not None and key.project_id == project.id and key.name == name:
            return saved
    for old in APIKey.objects.filter(project=project, name=name, revoked_at__isnull=True):
        old.revoke()
    _, plaintext = api_key_create(project=project, name=name, user=user)
    return plaintext


def _saved_demo_key() -> str | None:
    """The walkthrough's key as the last start wrote it to ``demo.env``."""
    path = _private_file("demo.env")
    if not path.exists():
        return None
    found = re.search(r"^export STEEP_KEY=(\S+)$", path.read_text(), re.M)
    return found[1] if found else None


def _demo_agent_key(project: Project, user) -> None:
    """The built-in demo agent's own key, kept across restarts while it still works."""
    path = _private_file("demo-agent.key")
    saved = path.read_text().strip() if path.exists() else None
    plaintext = _kept_key(project, user, name=DEMO_AGENT_KEY_NAME, saved=saved)
    if plaintext != saved:
        _write_private(path, plaintext + "\n")


def demo_bootstrap(
    *, model: str, username: str = "admin", password: str | None = None, start: bool = False
) -> Demo:
    """Idempotent: creates what is missing, and keeps the demo key ``demo.env`` holds while it
    works (a revoked one is replaced, and ``demo.env`` then holds the new one).

    With ``start``, the demo pool is started unless it runs (an interrupted one is left to
    the worker, which starts it again), and each demo run that can start (draft, stopped,
    failed, ...) is queued: the dataset run resumes from its last checkpoint; a completed
    one stays as it is.
    """
    if password is None:
        password, _ = _admin_password()
    user, _ = user_get_or_create(username=username, password=password, is_superuser=True)
    project, _ = bootstrap_project(project_name=DEMO_PROJECT, username=user.username)

    plaintext = _kept_key(project, user, name=DEMO_KEY_NAME, saved=_saved_demo_key())
    _demo_agent_key(project, user)

    pool = _demo_pool(model)
    run = _dataset_run(project, model, _dataset(project, user))
    online = _online_run(project, model)
    if start:
        if pool.status in (Pool.Status.STOPPED, Pool.Status.FAILED):
            pool_start(pool=pool)
        for demo_run in (online, run):
            if _startable(demo_run):
                run_start(run=demo_run)
    run.refresh_from_db()
    online.refresh_from_db()

    agent = Agent.objects.filter(project=project, name=DEMO_AGENT).first()
    if agent is None:
        agent = agent_create(project=project, name=DEMO_AGENT, run=online)
    elif agent.run_id != online.id:
        agent = agent_bind_run(agent=agent, run=online)

    env_file = _private_file("demo.env")
    _write_private(
        env_file,
        "# The README walkthrough's variables, written by ./steep up (the key is kept while it works).\n"
        f"export STEEP_URL={settings.SITE_URL}\n"
        f"export STEEP_KEY={plaintext}\n"
        f"export STEEP_BASE_URL={agent.base_url}\n"
        f"export STEEP_RUN={online.id}\n",
    )
    return Demo(
        username=user.username,
        password=password,
        project_id=str(project.id),
        api_key=plaintext,
        run_id=str(run.id),
        online_run_id=str(online.id),
        agent_base_url=agent.base_url,
        env_file=env_file,
    )


def demo_agent_credentials() -> tuple[str, str] | None:
    """(gateway URL, project key) for the built-in demo agent while the online demo run is
    running, else None."""
    agent = (
        Agent.objects.filter(project__name=DEMO_PROJECT, name=DEMO_AGENT)
        .select_related("run")
        .first()
    )
    path = _private_file("demo-agent.key")
    if agent is None or agent.run is None or not path.exists():
        return None
    if agent.run.status != Run.Status.RUNNING:
        return None
    return f"{settings.INTERNAL_API_URL}/agents/{agent.id}/v1", path.read_text().strip()
