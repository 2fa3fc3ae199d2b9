"""Fixtures for the pool tests: a staff operator's browser session and a stopped pool."""

from __future__ import annotations

import pytest


@pytest.fixture
def staff(db, django_user_model):
    return django_user_model.objects.create_user(
        username="operator", password="correct-horse-44", is_staff=True
    )


@pytest.fixture
def staff_api(staff):
    """A REST client logged in (session) as a staff user."""
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_login(staff)
    return client


@pytest.fixture
def make_pool(db):
    from webapp.pools.services import pool_create

    def make(name: str = "shared", base_model: str = "tiny-llama", **settings):
        settings.setdefault("start", False)
        return pool_create(name=name, base_model=base_model, **settings)

    return make
