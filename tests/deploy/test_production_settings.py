"""Production settings: refuse to start half-configured; behind a TLS proxy, pass ``check --deploy``.

Settings are read at import time, so each case runs in its own process with a
production environment (see conftest).
"""

from __future__ import annotations

import json

import pytest


def test_debug_off_without_secret_key_fails_saying_what_to_set(tmp_path, production_env, manage):
    result = manage(production_env(tmp_path, SECRET_KEY=None), "check")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "set SECRET_KEY (or SECRET_KEY_FILE)" in result.stderr


def test_debug_off_without_allowed_hosts_fails_saying_what_to_set(tmp_path, production_env, manage):
    result = manage(production_env(tmp_path, ALLOWED_HOSTS=None), "check")
    assert result.returncode != 0
    assert "ALLOWED_HOSTS is required when DEBUG is off" in result.stderr
    assert "ALLOWED_HOSTS=steep.example.com" in result.stderr


def test_debug_off_with_empty_allowed_hosts_fails(tmp_path, production_env, manage):
    result = manage(production_env(tmp_path, ALLOWED_HOSTS=" , "), "check")
    assert result.returncode != 0 and "ALLOWED_HOSTS is required" in result.stderr


def test_check_deploy_is_clean_in_production(tmp_path, production_env, manage):
    result = manage(production_env(tmp_path), "check", "--deploy", "--fail-level", "WARNING")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "System check identified no issues" in output
    assert "WARNINGS" not in output and "security.W" not in output


def test_check_deploy_warns_when_not_behind_a_tls_proxy(tmp_path, production_env, manage):
    # The secure settings come from BEHIND_TLS_PROXY, not from somewhere else.
    result = manage(
        production_env(tmp_path, BEHIND_TLS_PROXY="false"),
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    for check in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert check in output


def test_behind_a_tls_proxy_cookies_are_secure_and_hsts_is_on(tmp_path, production_env, run_django):
    code = """
import json
from django.conf import settings as s
print(json.dumps({
    "proxy": s.SECURE_PROXY_SSL_HEADER, "redirect": s.SECURE_SSL_REDIRECT,
    "session": s.SESSION_COOKIE_SECURE, "csrf": s.CSRF_COOKIE_SECURE,
    "hsts": s.SECURE_HSTS_SECONDS, "subdomains": s.SECURE_HSTS_INCLUDE_SUBDOMAINS,
    "preload": s.SECURE_HSTS_PRELOAD,
}))
"""
    result = run_django(code, production_env(tmp_path, SECURE_HSTS_SECONDS="3600"))
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout.strip().splitlines()[-1])
    assert values == {
        "proxy": ["HTTP_X_FORWARDED_PROTO", "https"],
        "redirect": True,
        "session": True,
        "csrf": True,
        "hsts": 3600,
        "subdomains": True,
        "preload": False,
    }


REQUESTS = """
import json
from django.test import Client
client = Client()
out = {}
for name, path, extra in [
    ("api_http", "/api/v1/project/", {}),
    ("api_https", "/api/v1/project/", {"HTTP_X_FORWARDED_PROTO": "https"}),
    ("healthz", "/healthz", {"HTTP_HOST": "10.0.0.7"}),
    ("readyz", "/readyz", {"HTTP_HOST": "10.0.0.7"}),
    ("internal", "/internal/v1/runs/00000000-0000-0000-0000-000000000000/config", {"HTTP_HOST": "web"}),
    ("unknown_host", "/api/v1/project/", {"HTTP_HOST": "evil.example", "HTTP_X_FORWARDED_PROTO": "https"}),
]:
    response = client.get(path, HTTP_HOST=extra.pop("HTTP_HOST", "steep.example.com"), **extra)
    out[name] = [response.status_code, response.get("Location"), response.get("Strict-Transport-Security")]
print(json.dumps(out))
"""


def test_http_is_redirected_except_probes_and_the_internal_api(
    tmp_path, production_env, run_django
):
    env = production_env(tmp_path, INTERNAL_API_URL="http://web:8000")
    result = run_django(REQUESTS, env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["api_http"][:2] == [301, "https://steep.example.com/api/v1/project/"]
    status, _, hsts = out["api_https"]
    assert status == 401 and hsts == "max-age=31536000; includeSubDomains"
    assert out["healthz"][0] == 200  # a probe: any Host, plain HTTP
    assert out["readyz"][0] == 200
    assert out["internal"][0] == 401  # reached over http://web:8000, refused for want of a secret
    assert out["unknown_host"][0] == 400


@pytest.mark.parametrize(
    "name,value,phrase",
    [
        ("LOG_FORMAT", "xml", "LOG_FORMAT='xml' is not a log format; use plain or json"),
        ("RATE_LIMIT_API_PER_MIN", "-1", "RATE_LIMIT_API_PER_MIN=-1 must be at least 0"),
        ("RATE_LIMIT_GATEWAY_PER_MIN", "lots", "RATE_LIMIT_GATEWAY_PER_MIN='lots'"),
        ("INTERNAL_API_ALLOWED_CIDRS", "10.0.0.0/8,intranet", "'intranet' is not a network"),
        ("BEHIND_TLS_PROXY", "maybe", "BEHIND_TLS_PROXY='maybe' is not a boolean"),
        ("RAY_JOB_NUM_GPUS", "-2", "RAY_JOB_NUM_GPUS=-2 must be at least 0"),
    ],
)
def test_bad_values_fail_naming_the_variable(tmp_path, production_env, manage, name, value, phrase):
    result = manage(production_env(tmp_path, **{name: value}), "check")
    assert result.returncode != 0
    assert phrase in result.stderr


def test_the_internal_api_host_is_allowed_without_listing_it(tmp_path, production_env, run_django):
    code = "from django.conf import settings\nprint(settings.ALLOWED_HOSTS)"
    result = run_django(code, production_env(tmp_path, INTERNAL_API_URL="http://web:8000"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "['steep.example.com', 'web']"
