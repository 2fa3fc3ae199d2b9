"""docker-compose.yml runs the whole platform, and every knob it and the code read is documented.

Parsed with PyYAML (anchors and ``<<`` merges resolved) rather than trusted by eye;
``docker-compose config`` validates it for real where the binary is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "deploy" / ".env.example"

APP_SERVICES = ("web", "worker")
RAY_SERVICES = ("ray-head", "ray-worker")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def compose_variables() -> set[str]:
    return set(re.findall(r"(?<!\$)\$\{([A-Z][A-Z0-9_]*)", COMPOSE.read_text()))


def settings_variables() -> set[str]:
    source = (ROOT / "webapp" / "settings.py").read_text()
    names = set(re.findall(r"env(?:str|int|bool|secret|list)\(\s*\"([A-Z][A-Z0-9_]*)\"", source))
    # envsecret("X") also reads X_FILE; docs/configuration.md documents them together.
    return names


def env_example_variables() -> set[str]:
    return set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.MULTILINE))


def documented_variables() -> set[str]:
    """The variables of docs/configuration.md's table."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    section = page.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]*)`", first_cell))
    return names


def test_the_services_of_a_gpu_team_exist(services):
    assert {"postgres", "redis", "web", "worker", "ray-head", "ray-worker"} <= set(services)


@pytest.mark.parametrize("name", ["postgres", "redis", "web", "ray-head"])
def test_services_others_wait_for_have_healthchecks(services, name):
    test = services[name]["healthcheck"]["test"]
    assert test and test[0] in ("CMD", "CMD-SHELL")


def test_web_serves_asgi_with_several_workers_after_migrating(services):
    web = services["web"]
    command = " ".join(web["command"])
    assert "uvicorn webapp.asgi:application" in command
    assert "--workers=${WEB_WORKERS:-4}" in command
    assert web["entrypoint"] == ["/app/deploy/entrypoint.sh"]
    entrypoint = (ROOT / "deploy" / "entrypoint.sh").read_text()
    assert "migrate --noinput" in entrypoint and "STEEP_ADMIN_PASSWORD" in entrypoint
    assert "/healthz" in " ".join(web["healthcheck"]["test"])


def test_worker_runs_celery_with_beat_once_the_database_is_migrated(services):
    worker = services["worker"]
    assert worker["command"][:4] == ["celery", "-A", "workers", "worker"]
    assert "-B" in worker["command"]
    assert worker["depends_on"]["web"]["condition"] == "service_healthy"


def test_the_ray_head_listens_inside_the_network_with_token_auth(services):
    head = services["ray-head"]
    command = head["command"]
    assert command[:2] == ["ray", "start"]
    for flag in ("--head", "--block", "--dashboard-host=0.0.0.0", "--dashboard-port=8265"):
        assert flag in command
    assert head["image"] == services["web"]["image"]  # the CPU image: it runs job drivers
    assert all(port.startswith("127.0.0.1:") for port in head.get("ports", []))


def test_every_ray_node_and_client_shares_one_auth_token(services):
    tokens = set()
    for name in APP_SERVICES + RAY_SERVICES:
        env = services[name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token", name
        tokens.add(env["RAY_AUTH_TOKEN"])
    assert len(tokens) == 1 and tokens.pop().startswith("${RAY_AUTH_TOKEN:?")


def test_web_and_worker_point_at_the_head_and_the_head_can_call_back(services):
    for name in APP_SERVICES:
        env = services[name]["environment"]
        assert env["RAY_ADDRESS"] == "${RAY_ADDRESS:-ray-head:6379}"
        assert env["INTERNAL_API_URL"] == "${INTERNAL_API_URL:-http://web:8000}"
        assert env["DATABASE_URL"].endswith("@postgres:5432/steep}")
        assert env["REDIS_URL"] == "${REDIS_URL:-redis://redis:6379/0}"


def test_gpu_worker_is_a_profile_built_from_the_cuda_image(services):
    gpu = services["ray-worker"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.gpu"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    assert "--address=ray-head:6379" in gpu["command"]
    dockerfile = (ROOT / "deploy" / "Dockerfile.gpu").read_text()
    assert "sglang==" in dockerfile and "torch==" in dockerfile


def test_every_service_that_touches_weights_shares_data_dir(services):
    for name in APP_SERVICES + RAY_SERVICES:
        service = services[name]
        assert service["environment"]["DATA_DIR"] == "/data", name
        assert "steep-data:/data" in service["volumes"], name


def test_ray_nodes_of_both_images_install_the_same_ray():
    constraints = (ROOT / "deploy" / "constraints.txt").read_text()
    assert re.search(r"^ray==\d+\.\d+\.\d+$", constraints, re.MULTILINE)
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        assert "-c constraints.txt" in (ROOT / "deploy" / dockerfile).read_text(), dockerfile


def test_base_images_are_pinned_by_tag(services):
    images = [
        line.split()[1]
        for dockerfile in ("Dockerfile", "Dockerfile.gpu")
        for line in (ROOT / "deploy" / dockerfile).read_text().splitlines()
        if line.startswith("FROM ")
    ]
    images += [services[name]["image"] for name in ("postgres", "redis")]
    assert len(images) >= 4
    for image in images:
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d", tag), image


def test_every_compose_variable_is_documented():
    used = compose_variables()
    assert {"SECRET_KEY", "RAY_AUTH_TOKEN", "WEB_WORKERS"} <= used
    assert used - env_example_variables() == set(), "missing from deploy/.env.example"
    assert used - documented_variables() == set(), "missing from docs/configuration.md's table"


def test_every_setting_the_code_reads_is_documented():
    read = settings_variables()
    assert {"DEBUG", "SECRET_KEY", "RATE_LIMIT_API_PER_MIN", "LOG_FORMAT"} <= read
    assert read - env_example_variables() == set(), "missing from deploy/.env.example"
    assert read - documented_variables() == set(), "missing from docs/configuration.md's table"


DOCKER_COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose is not installed")
@pytest.mark.parametrize(
    "profile",
    [[], ["--profile", "gpu"], ["--profile", "monitoring"]],
    ids=["default", "gpu", "monitoring"],
)
def test_docker_compose_config_accepts_the_file(profile):
    result = subprocess.run(
        [DOCKER_COMPOSE, "--env-file", str(ENV_EXAMPLE), *profile, "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert "ray-worker" in resolved["services"]
    web_env = resolved["services"]["web"]["environment"]
    assert web_env["RAY_ADDRESS"] == "ray-head:6379"
    assert (
        web_env["RAY_AUTH_TOKEN"]
        == resolved["services"]["ray-head"]["environment"]["RAY_AUTH_TOKEN"]
    )


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose is not installed")
def test_docker_compose_refuses_to_start_ray_without_a_token(tmp_path):
    empty_env = tmp_path / "empty.env"
    empty_env.write_text("")
    result = subprocess.run(
        [DOCKER_COMPOSE, "--env-file", str(empty_env), "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0 and "RAY_AUTH_TOKEN" in result.stderr
