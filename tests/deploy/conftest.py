"""Helpers for the deployment tests.

- ``production_env(tmp_path, **overrides)``: the environment of a production process
  (DEBUG off, a long random SECRET_KEY, ALLOWED_HOSTS, behind a TLS proxy, SQLite in
  ``tmp_path``), without the embedded-mode variables of the machine running the tests.
- ``run_django(code, env)``: ``code`` in a fresh interpreter after ``django.setup()``
  (settings are read at import time, so each production setting gets its own process).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Everything the settings read: a test's process starts from none of them.
_SETTINGS_PREFIXES = (
    "DEBUG",
    "SECRET_KEY",
    "ALLOWED_HOSTS",
    "SITE_URL",
    "CSRF_TRUSTED_ORIGINS",
    "BEHIND_TLS_PROXY",
    "SECURE_HSTS",
    "DATABASE_URL",
    "REDIS_URL",
    "RAY_",
    "INTERNAL_API",
    "LOG_",
    "RATE_LIMIT",
)


def _production_env(tmp_path: Path, **overrides: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SETTINGS_PREFIXES)}
    env |= {
        "DJANGO_SETTINGS_MODULE": "webapp.settings",
        "DATA_DIR": str(tmp_path),
        "DEBUG": "false",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "ALLOWED_HOSTS": "steep.example.com",
        "SITE_URL": "https://steep.example.com",
        "BEHIND_TLS_PROXY": "true",
    }
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@pytest.fixture
def production_env():
    return _production_env


def _run_django(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    script = "import django\ndjango.setup()\n" + code
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def run_django():
    return _run_django


@pytest.fixture
def manage():
    def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run
