"""``manage.py create_api_key``: bootstrap a project (and user) and print a working key last."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from rest_framework.test import APIClient

from webapp.accounts.models import APIKey, Membership, Project

pytestmark = pytest.mark.django_db


def create_api_key(*args: str) -> str:
    stdout, stderr = io.StringIO(), io.StringIO()
    call_command("create_api_key", *args, stdout=stdout, stderr=stderr)
    return stdout.getvalue()


def get_project(plaintext: str):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client.get("/api/v1/project/")


def test_it_creates_project_and_user_and_prints_a_working_key_last():
    out = create_api_key("--project", "demo", "--user", "grace")
    plaintext = out.strip().splitlines()[-1]

    project = Project.objects.get(name="demo")
    user = get_user_model().objects.get(username="grace")
    assert Membership.objects.get(project=project, user=user).role == Membership.Role.OWNER
    key = APIKey.objects.get(project=project)
    assert key.name == "cli" and key.created_by == user

    response = get_project(plaintext)
    assert response.status_code == 200
    assert response.json() == {
        "id": str(project.id),
        "name": "demo",
        "created_at": response.json()["created_at"],
    }


def test_it_reuses_an_existing_project_and_adds_a_second_key(project):
    first = create_api_key("--project", project.name).strip().splitlines()[-1]
    second = create_api_key("--project", project.name, "--name", "ci").strip().splitlines()[-1]
    assert first != second
    assert Project.objects.filter(name=project.name).count() == 1
    assert set(APIKey.objects.filter(project=project).values_list("name", flat=True)) == {
        "cli",
        "ci",
    }
    assert get_project(first).json()["id"] == str(project.id)
    assert get_project(second).json()["id"] == str(project.id)


def test_it_without_user_creates_an_ownerless_project():
    plaintext = create_api_key("--project", "headless").strip().splitlines()[-1]
    project = Project.objects.get(name="headless")
    assert not project.memberships.exists()
    assert get_project(plaintext).status_code == 200


def test_it_makes_an_existing_user_owner_of_an_existing_project(project, other_user):
    create_api_key("--project", project.name, "--user", other_user.username)
    assert Membership.objects.get(project=project, user=other_user).role == "owner"
    assert get_user_model().objects.filter(username=other_user.username).count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_prints_the_key_as_the_last_line_of_a_real_process_stdout(subprocess_env, settings):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", "--project", "shell", "--user", "linus"],
        cwd=settings.BASE_DIR,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    plaintext = result.stdout.strip().splitlines()[-1]
    assert plaintext.startswith("sk-steep-")
    assert plaintext not in result.stderr
    response = get_project(plaintext)
    assert response.status_code == 200
    assert response.json()["name"] == "shell"
