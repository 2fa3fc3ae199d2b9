"""Signing up creates a user and logs them in; logging in and out works."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

pytestmark = pytest.mark.django_db


def test_signup_creates_a_user_and_logs_in(client):
    response = client.post(
        reverse("dashboard:signup"),
        {
            "username": "newbie",
            "password1": "a-long-passphrase-9",
            "password2": "a-long-passphrase-9",
        },
    )
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:projects")
    user = get_user_model().objects.get(username="newbie")
    assert user.check_password("a-long-passphrase-9")
    assert not user.is_staff and not user.is_superuser
    page = client.get(reverse("dashboard:projects"))
    assert page.status_code == 200
    assert page.wsgi_request.user == user
    assert "No projects yet" in page.content.decode()


@pytest.mark.parametrize(
    "password1,password2",
    [("a-long-passphrase-9", "a-different-one-9"), ("short", "short"), ("password", "password")],
)
def test_signup_with_a_bad_password_creates_nobody(client, password1, password2):
    response = client.post(
        reverse("dashboard:signup"),
        {"username": "newbie", "password1": password1, "password2": password2},
    )
    assert response.status_code == 200
    assert response.context["form"].errors
    assert not get_user_model().objects.filter(username="newbie").exists()
    assert not response.wsgi_request.user.is_authenticated


def test_signup_with_a_taken_username_is_refused(client, owner):
    response = client.post(
        reverse("dashboard:signup"),
        {
            "username": owner.username,
            "password1": "a-long-passphrase-9",
            "password2": "a-long-passphrase-9",
        },
    )
    assert response.status_code == 200
    assert "username" in response.context["form"].errors


def test_login_and_logout(client, owner):
    response = client.post(
        reverse("dashboard:login"), {"username": "ada", "password": "correct-horse-42"}
    )
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:projects")
    assert client.get(reverse("dashboard:projects")).status_code == 200
    assert client.post(reverse("dashboard:logout")).status_code == 302
    assert client.get(reverse("dashboard:projects")).status_code == 302


def test_wrong_password_does_not_log_in(client, owner):
    response = client.post(reverse("dashboard:login"), {"username": "ada", "password": "nope"})
    assert response.status_code == 200
    assert not response.wsgi_request.user.is_authenticated
