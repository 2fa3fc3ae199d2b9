"""The demo that ``./steep up`` sets up: a user, a project, a key, a dataset, a run and an agent."""

from __future__ import annotations

import io
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from rl_core.config import RunConfig
from rl_core.toy import TOY_SETTINGS, toy_rows
from webapp.accounts.models import APIKey
from webapp.accounts.services import api_key_create, bootstrap_project, user_get_or_create
from webapp.agents.models import Agent
from webapp.agents.services import agent_create
from webapp.datasets.models import Dataset
from webapp.datasets.services import dataset_create
from webapp.runs.models import Run
from webapp.runs.services import run_create, run_start

DEMO_PROJECT = "demo"
DEMO_KEY_NAME = "steep up demo key"
DEMO_DATASET = "say-a-letter"
DEMO_RUN = "demo: learn to say the letter asked for"


@dataclass
class Demo:
    username: str
    password: str | None
    project_id: str
    api_key: str
    run_id: str
    agent_base_url: str


def _admin_password() -> tuple[str, bool]:
    path = Path(settings.DATA_DIR) / "admin-password.txt"
    if path.exists():
        return path.read_text().strip(), False
    password = secrets.token_urlsafe(12)
    path.write_text(password + "\n")
    path.chmod(0o600)
    return password, True


def demo_bootstrap(
    *, model: str, username: str = "admin", password: str | None = None, start: bool = False
) -> Demo:
    """Idempotent: creates what is missing; rotates the demo key so it can be printed.

    With ``start``, a demo run that is not running is (re)started: it trains the toy
    task (``rl_core.toy``) so the reward curve visibly rises within minutes on a laptop.
    """
    if password is None:
        password, _ = _admin_password()
    user, _ = user_get_or_create(username=username, password=password, is_superuser=True)
    project, _ = bootstrap_project(project_name=DEMO_PROJECT, username=user.username)

    for old in APIKey.objects.filter(project=project, name=DEMO_KEY_NAME, revoked_at__isnull=True):
        old.revoke()
    _, plaintext = api_key_create(project=project, name=DEMO_KEY_NAME, user=user)

    dataset = Dataset.objects.filter(project=project, name=DEMO_DATASET).first()
    if dataset is None:
        body = "".join(json.dumps(row) + "\n" for row in toy_rows(256)).encode()
        dataset = dataset_create(
            project=project, name=DEMO_DATASET, file=io.BytesIO(body), user=user
        )

    run = Run.objects.filter(project=project, name=DEMO_RUN).first()
    if run is None:
        config = RunConfig.from_dict({"mode": "dataset", "base_model": model, **TOY_SETTINGS})
        run = run_create(project=project, name=DEMO_RUN, config=config, dataset=dataset)

    if start and run.status in (Run.Status.DRAFT, Run.Status.STOPPED, Run.Status.FAILED):
        run = run_start(run=run)

    agent = Agent.objects.filter(project=project, name="demo agent").first() or agent_create(
        project=project, name="demo agent", run=run
    )
    return Demo(
        username=user.username,
        password=password,
        project_id=str(project.id),
        api_key=plaintext,
        run_id=str(run.id),
        agent_base_url=agent.base_url,
    )
