"""Shared fixtures for the web tests.

- ``owner`` owns ``project``; ``api_key`` is a plaintext key of that project and
  ``api`` an APIClient that sends it as ``Authorization: Bearer``.
- ``other_user`` owns ``other_project`` and drives ``other_api``: the third party
  who must always be refused access to ``project``'s objects.
- ``make_dataset``, ``make_run``, ``make_agent`` create objects through the services,
  exactly as the API would.
- ``api_error(response, status)`` checks the REST error shape and returns ``error``.

Django is configured before this file loads, from the environment: run the suite
with ``DATA_DIR`` pointing at a scratch directory (the SQLite test database and the
embedded broker live there).
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def test_database_url() -> str:
    """A DATABASE_URL for child processes (worker, web server, job) that names this test database."""
    from urllib.parse import quote

    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = quote(db["USER"] or "", safe="")
    if db["PASSWORD"]:
        auth += ":" + quote(db["PASSWORD"], safe="")
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgres://{auth}@{db['HOST'] or 'localhost'}{port}/{db['NAME']}"


test_database_url.__test__ = False  # a helper, not a test


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``STEEP_TEST_SHUFFLE=<seed>``: run the files in a shuffled order, and each file's tests
    in a shuffled order (a file's tests stay together, so module fixtures start once), to
    catch a test that passes only after the ones its file puts before it."""
    seed = os.environ.get("STEEP_TEST_SHUFFLE")
    if not seed:
        return
    rng = random.Random(seed)
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(files.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = os.environ.get("STEEP_TEST_SHUFFLE")
    return f"tests shuffled: STEEP_TEST_SHUFFLE={seed}" if seed else None


# Model names the tests give runs and pools without building a model (a run that is created
# and inspected, never started): directories in the tests' own model root.
TEST_MODEL_NAMES = ("tiny-llama", "m", "tiny-model", "other-model")


@pytest.fixture(autouse=True, scope="session")
def _test_model_roots(tmp_path_factory: pytest.TempPathFactory):
    """The instance's model roots in the tests (``STEEP_MODEL_ROOTS``, rl_core.sources): the
    data directory's models, a folder of the names above, the session's temporary folder
    (where fixtures build their models) and the folder of the real models the tests share with
    the benchmarks (SmolLM2, tests/smollm2.py). Set in the environment too, for the processes
    the tests start."""
    from django.conf import settings

    from tests.smollm2 import MODEL_DIR

    base = tmp_path_factory.getbasetemp()
    for name in TEST_MODEL_NAMES:
        (base / "models" / name).mkdir(parents=True, exist_ok=True)
    roots = [str(Path(settings.DATA_DIR) / "models"), str(base / "models"), str(base)]
    roots.append(str(MODEL_DIR.parent))
    saved = os.environ.get("STEEP_MODEL_ROOTS"), settings.STEEP_MODEL_ROOTS
    os.environ["STEEP_MODEL_ROOTS"] = ",".join(roots)
    settings.STEEP_MODEL_ROOTS = roots
    yield roots
    if saved[0] is None:
        os.environ.pop("STEEP_MODEL_ROOTS", None)
    else:
        os.environ["STEEP_MODEL_ROOTS"] = saved[0]
    settings.STEEP_MODEL_ROOTS = saved[1]


@pytest.fixture
def model_named(_test_model_roots) -> Callable[[str], str]:
    """``model_named("tiny-llama")``: the directory a run's base_model of that name is stored as."""
    return lambda name: os.path.realpath(Path(_test_model_roots[1]) / name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (rl_core.tiny), built once per session."""
    from rl_core.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-model")


@pytest.fixture(scope="session")
def perturbed_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with noised weights (same architecture): "the next policy version"."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.5 * param.std())
    out = tmp_path_factory.getbasetemp() / "tiny-model-perturbed"
    model.save_pretrained(out)
    return out


def jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


SAMPLE_ROWS = [
    {"prompt": "What is 2 + 2?", "answer": "4", "metadata": {"source": "arithmetic"}},
    {
        "messages": [
            {"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "answer": "Paris",
    },
]


@pytest.fixture
def sample_rows() -> list[dict]:
    """One prompt row and one messages row, with answers and metadata."""
    return json.loads(json.dumps(SAMPLE_ROWS))


@pytest.fixture(name="jsonl")
def jsonl_fixture() -> Callable[[list[Any]], bytes]:
    """``jsonl(rows)``: the bytes of a JSONL file."""
    return jsonl


@pytest.fixture(autouse=True, scope="session")
def _fast_password_hashing():
    """PBKDF2 costs ~0.3 s per user on a small machine; the tests don't need its strength."""
    from django.test.utils import override_settings

    with override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"]):
        yield


@pytest.fixture
def owner(db, django_user_model):
    return django_user_model.objects.create_user(username="ada", password="correct-horse-42")


@pytest.fixture
def project(owner):
    from webapp.accounts.services import project_create

    return project_create(name="acme", owner=owner)


@pytest.fixture
def api_key(project, owner) -> str:
    from webapp.accounts.services import api_key_create

    _, plaintext = api_key_create(project=project, name="tests", user=owner)
    return plaintext


def _client_for(plaintext: str):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


@pytest.fixture
def api(api_key):
    return _client_for(api_key)


@pytest.fixture
def other_user(db, django_user_model):
    return django_user_model.objects.create_user(username="mallory", password="correct-horse-43")


@pytest.fixture
def other_project(other_user):
    from webapp.accounts.services import project_create

    return project_create(name="rival", owner=other_user)


@pytest.fixture
def other_api_key(other_project, other_user) -> str:
    from webapp.accounts.services import api_key_create

    _, plaintext = api_key_create(project=other_project, name="rival", user=other_user)
    return plaintext


@pytest.fixture
def other_api(other_api_key):
    return _client_for(other_api_key)


@pytest.fixture
def anon_api(db):
    from rest_framework.test import APIClient

    return APIClient()


@pytest.fixture
def member_client(client, owner):
    """A browser session logged in as ``owner``."""
    client.force_login(owner)
    return client


@pytest.fixture
def outsider_client(other_user):
    """A browser session logged in as ``other_user``, who is not a member of ``project``."""
    from django.test import Client

    browser = Client()
    browser.force_login(other_user)
    return browser


@pytest.fixture
def make_dataset(db) -> Callable[..., Any]:
    from webapp.datasets.services import dataset_create

    def make(project, name: str = "prompts", rows: list[Any] | None = None):
        content = jsonl(rows if rows is not None else SAMPLE_ROWS)
        return dataset_create(project=project, name=name, file=io.BytesIO(content))

    return make


@pytest.fixture
def make_run(db) -> Callable[..., Any]:
    from rl_core.config import RunConfig
    from webapp.runs.services import run_create

    def make(project, name: str = "run", dataset=None, **settings: Any):
        values: dict[str, Any] = {"base_model": "tiny-llama"}
        if dataset is not None:
            values |= {"mode": "dataset", "reward": {"type": "exact_match"}}
        else:
            values["mode"] = "online"
        values |= settings
        return run_create(
            project=project, name=name, config=RunConfig.from_dict(values), dataset=dataset
        )

    return make


@pytest.fixture
def make_agent(db) -> Callable[..., Any]:
    from webapp.agents.services import agent_create

    def make(project, name: str = "agent", run=None):
        return agent_create(project=project, name=name, run=run)

    return make


@pytest.fixture
def set_status() -> Callable[..., Any]:
    """Put a run straight into a status (bypassing the state machine) to set up a test."""

    def set_to(run, status: str):
        type(run).objects.filter(pk=run.pk).update(status=status)
        run.refresh_from_db()
        return run

    return set_to


@pytest.fixture
def subprocess_env(settings) -> dict[str, str]:
    """Environment for a child process (worker, manage.py) that shares this test's database.

    Only meaningful with ``django_db(transaction=True)``: otherwise the child can't see
    uncommitted rows.
    """
    import os

    url = test_database_url()
    env = dict(os.environ)
    env |= {
        "DJANGO_SETTINGS_MODULE": "webapp.settings",
        "DATA_DIR": str(settings.DATA_DIR),
        "DATABASE_URL": url,
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DATABASE_URL_FILE", None)
    if settings.REDIS_URL:
        env["REDIS_URL"] = settings.REDIS_URL
    return env


def _api_error(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "code", "fields"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["fields"], dict)
    return error


@pytest.fixture
def api_error() -> Callable[[Any, int], dict]:
    return _api_error
