"""Settings read the environment through typed helpers that fail loudly, naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from webapp.env import database_from_url, envbool, envint, envlist, envsecret

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
        ("", False),
    ],
)
def test_envbool_reads_the_usual_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("STEEP_FLAG", raw)
    assert envbool("STEEP_FLAG", not expected) is expected


def test_envbool_default_when_unset(monkeypatch):
    monkeypatch.delenv("STEEP_FLAG", raising=False)
    assert envbool("STEEP_FLAG", True) is True


@pytest.mark.parametrize("raw", ["maybe", "2", "yes please"])
def test_envbool_bad_value_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("STEEP_FLAG", raw)
    with pytest.raises(ImproperlyConfigured, match="STEEP_FLAG"):
        envbool("STEEP_FLAG", False)


def test_envint_reads_numbers_and_defaults(monkeypatch):
    monkeypatch.setenv("STEEP_N", " 16_777_216 ")
    assert envint("STEEP_N", 1) == 16_777_216
    monkeypatch.setenv("STEEP_N", "")
    assert envint("STEEP_N", 7) == 7
    monkeypatch.delenv("STEEP_N")
    assert envint("STEEP_N", 7) == 7


@pytest.mark.parametrize("raw", ["lots", "1.5", "16MB"])
def test_envint_bad_value_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("STEEP_N", raw)
    with pytest.raises(ImproperlyConfigured, match="STEEP_N"):
        envint("STEEP_N", 1)


def test_envint_below_minimum_names_the_variable(monkeypatch):
    monkeypatch.setenv("STEEP_N", "10")
    with pytest.raises(ImproperlyConfigured, match="STEEP_N=10 must be at least 1024"):
        envint("STEEP_N", 2048, minimum=1024)


def test_envlist_splits_and_trims(monkeypatch):
    monkeypatch.setenv("STEEP_HOSTS", " a.example , b.example,, ")
    assert envlist("STEEP_HOSTS", []) == ["a.example", "b.example"]
    monkeypatch.delenv("STEEP_HOSTS")
    assert envlist("STEEP_HOSTS", ["x"]) == ["x"]


def test_secret_is_read_from_its_file(monkeypatch, tmp_path):
    secret = tmp_path / "secret_key"
    secret.write_text("s3cret-from-a-file\n")
    monkeypatch.setenv("SECRET_KEY", "from-the-environment")
    monkeypatch.setenv("SECRET_KEY_FILE", str(secret))
    assert envsecret("SECRET_KEY") == "s3cret-from-a-file"


def test_secret_without_a_file_comes_from_the_variable(monkeypatch):
    monkeypatch.delenv("SECRET_KEY_FILE", raising=False)
    monkeypatch.setenv("SECRET_KEY", "plain")
    assert envsecret("SECRET_KEY") == "plain"


def test_unreadable_secret_file_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("SECRET_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="SECRET_KEY_FILE"):
        envsecret("SECRET_KEY")


def test_database_from_postgres_url():
    db = database_from_url("postgres://steep:p%40ss%2Fword@db.internal:5433/steep?sslmode=require")
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["NAME"], db["USER"], db["PASSWORD"]) == ("steep", "steep", "p@ss/word")
    assert (db["HOST"], db["PORT"]) == ("db.internal", "5433")
    assert db["OPTIONS"] == {"sslmode": "require"}
    assert database_from_url("postgresql://u@h/d")["PORT"] == ""


@pytest.mark.parametrize(("given", "taken"), [("none", None), ("OFF", None), ("3", 3)])
def test_prepare_threshold_in_the_postgres_url_is_what_psycopg_takes(given, taken):
    db = database_from_url(f"postgres://u@h/d?sslmode=require&prepare_threshold={given}")
    assert db["OPTIONS"] == {"sslmode": "require", "prepare_threshold": taken}


def test_a_prepare_threshold_that_is_no_number_is_refused_by_name():
    with pytest.raises(ImproperlyConfigured, match="prepare_threshold='soon'"):
        database_from_url("postgres://u@h/d?prepare_threshold=soon")


def test_database_from_sqlite_url():
    db = database_from_url("sqlite:////var/lib/steep/db.sqlite3")
    assert db["ENGINE"] == "django.db.backends.sqlite3"
    assert db["NAME"] == "/var/lib/steep/db.sqlite3"
    assert database_from_url("sqlite:///data/steep.sqlite3")["NAME"] == "data/steep.sqlite3"
    assert database_from_url("sqlite:////tmp/a%20b.db")["NAME"] == "/tmp/a b.db"


@pytest.mark.parametrize(
    "url,phrase",
    [
        ("mysql://u:p@h/steep", "'mysql' is not supported"),
        ("redis://localhost:6379/0", "'redis' is not supported"),
        ("postgres://u@h:5432/", "names no database"),
        ("sqlite:///", "needs a file path"),
        ("sqlite:////", "needs a file path"),
    ],
)
def test_database_url_problems_are_explained(url, phrase):
    with pytest.raises(ImproperlyConfigured, match=phrase):
        database_from_url(url)


def load_settings(tmp_path, **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SECRET_KEY", "DEBUG", "ALLOWED_HOSTS"))
    }
    clean |= {"DJANGO_SETTINGS_MODULE": "webapp.settings", "DATA_DIR": str(tmp_path)} | env
    return subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; print(settings.DEBUG)"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_settings_refuse_to_load_without_secret_key_when_debug_is_off(tmp_path):
    result = load_settings(tmp_path, DEBUG="false")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "SECRET_KEY" in result.stderr


def test_settings_load_with_debug_off_a_secret_key_and_allowed_hosts(tmp_path):
    secret = tmp_path / "key"
    secret.write_text("a-long-random-production-secret")
    result = load_settings(
        tmp_path, DEBUG="false", SECRET_KEY_FILE=str(secret), ALLOWED_HOSTS="steep.example.com"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_settings_refuse_a_bad_boolean(tmp_path):
    result = load_settings(tmp_path, DEBUG="sometimes")
    assert result.returncode != 0 and "DEBUG='sometimes'" in result.stderr


def test_settings_refuse_a_tiny_request_limit(tmp_path):
    result = load_settings(tmp_path, MAX_REQUEST_BYTES="10")
    assert result.returncode != 0 and "MAX_REQUEST_BYTES=10" in result.stderr
