"""Project keys: stored only as a SHA-256, shown once, refused when revoked, expired or malformed."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from webapp.accounts.keys import PROJECT_KEY_PREFIX
from webapp.accounts.models import APIKey
from webapp.accounts.services import api_key_authenticate, api_key_create

pytestmark = pytest.mark.django_db


def test_plaintext_key_is_never_stored_only_its_sha256(project):
    key, plaintext = api_key_create(project=project, name="ci")
    secret_part = plaintext.removeprefix(PROJECT_KEY_PREFIX)
    assert plaintext.startswith(PROJECT_KEY_PREFIX) and len(secret_part) >= 40

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {APIKey._meta.db_table}")
        raw_rows = cursor.fetchall()
    assert len(raw_rows) == 1
    for value in [*raw_rows[0], *APIKey.objects.filter(pk=key.pk).values().get().values()]:
        assert plaintext not in str(value)
        assert secret_part[:12] not in str(value)

    stored = APIKey.objects.get(pk=key.pk)
    assert stored.hashed == hashlib.sha256(plaintext.encode()).hexdigest()
    assert stored.prefix == plaintext[: len(stored.prefix)] and len(stored.prefix) < 20


def test_created_key_is_returned_once_and_works(api, anon_api, project):
    response = api.post("/api/v1/keys/", {"name": "laptop"}, format="json")
    assert response.status_code == 201
    body = response.json()
    plaintext = body["key"]
    assert plaintext.startswith(PROJECT_KEY_PREFIX)
    assert body["prefix"] == plaintext[: len(body["prefix"])]
    assert body["name"] == "laptop" and body["is_active"] is True

    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert anon_api.get("/api/v1/project/").json()["id"] == str(project.id)

    listing = api.get("/api/v1/keys/")
    assert listing.status_code == 200
    assert plaintext not in listing.content.decode()
    assert all("key" not in row for row in listing.json()["results"])
    assert body["id"] in {row["id"] for row in listing.json()["results"]}


def test_revoked_key_is_401(api, anon_api, project):
    key, plaintext = api_key_create(project=project, name="doomed")
    response = api.post(f"/api/v1/keys/{key.id}/revoke/")
    assert response.status_code == 200
    assert response.json()["is_active"] is False and response.json()["revoked_at"]

    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    error = anon_api.get("/api/v1/project/")
    assert error.status_code == 401
    assert error.json()["error"]["code"] == "authentication_failed"


def test_delete_revokes_the_key_and_keeps_the_record(api, anon_api, project):
    key, plaintext = api_key_create(project=project)
    response = api.delete(f"/api/v1/keys/{key.id}/")
    assert response.status_code == 200
    key.refresh_from_db()
    assert key.revoked_at is not None

    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert anon_api.get("/api/v1/runs/").status_code == 401


def test_a_key_can_revoke_itself_and_is_refused_afterwards(api, api_key, project):
    own = APIKey.objects.get(hashed=hashlib.sha256(api_key.encode()).hexdigest())
    assert api.post(f"/api/v1/keys/{own.id}/revoke/").status_code == 200
    assert api.get("/api/v1/project/").status_code == 401


def test_expired_key_is_401(anon_api, project, api_error):
    _, plaintext = api_key_create(project=project, expires_at=timezone.now() - timedelta(seconds=1))
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    api_error(anon_api.get("/api/v1/project/"), 401)


def test_key_expiring_in_the_future_works(anon_api, project):
    _, plaintext = api_key_create(project=project, expires_at=timezone.now() + timedelta(hours=1))
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert anon_api.get("/api/v1/project/").status_code == 200


def test_key_created_over_the_api_with_a_past_expiry_is_refused(api, anon_api):
    past = (timezone.now() - timedelta(days=1)).isoformat()
    plaintext = api.post("/api/v1/keys/", {"expires_at": past}, format="json").json()["key"]
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert anon_api.get("/api/v1/project/").status_code == 401


@pytest.mark.parametrize(
    "header",
    [
        "Token {key}",
        "Basic dXNlcjpwYXNz",
        "{key}",
        "Bearer",
        "Bearer    ",
        "Bearer garbage",
        "Bearer sk-steep-thisisnotakeythisisnotakeythisisnotakey0",
        "Bearer {key}x",
    ],
)
def test_wrong_scheme_or_garbage_key_is_401_with_the_error_shape(
    anon_api, api_key, api_error, header
):
    anon_api.credentials(HTTP_AUTHORIZATION=header.format(key=api_key))
    response = anon_api.get("/api/v1/runs/")
    error = api_error(response, 401)
    assert error["code"] == "authentication_failed"
    assert response["WWW-Authenticate"] == "Bearer"


def test_bearer_scheme_is_case_insensitive(anon_api, api_key):
    anon_api.credentials(HTTP_AUTHORIZATION=f"bearer {api_key}")
    assert anon_api.get("/api/v1/project/").status_code == 200


def test_using_a_key_records_last_used_at(api, api_key):
    key = APIKey.objects.get(hashed=hashlib.sha256(api_key.encode()).hexdigest())
    assert key.last_used_at is None
    before = timezone.now()
    assert api.get("/api/v1/project/").status_code == 200
    key.refresh_from_db()
    assert key.last_used_at is not None and key.last_used_at >= before


def test_last_used_at_is_written_at_most_once_a_minute(project):
    key, plaintext = api_key_create(project=project)
    recent = timezone.now() - timedelta(seconds=10)
    APIKey.objects.filter(pk=key.pk).update(last_used_at=recent)
    assert api_key_authenticate(plaintext=plaintext).pk == key.pk
    key.refresh_from_db()
    assert key.last_used_at == recent

    stale = timezone.now() - timedelta(minutes=5)
    APIKey.objects.filter(pk=key.pk).update(last_used_at=stale)
    api_key_authenticate(plaintext=plaintext)
    key.refresh_from_db()
    assert key.last_used_at > stale + timedelta(minutes=4)


def test_empty_plaintext_authenticates_nothing(project):
    assert api_key_authenticate(plaintext="") is None


def test_key_list_shows_prefix_status_and_no_hash(api, project):
    revoked, _ = api_key_create(project=project, name="old")
    revoked.revoke()
    rows = {row["id"]: row for row in api.get("/api/v1/keys/").json()["results"]}
    assert rows[str(revoked.id)]["is_active"] is False
    assert rows[str(revoked.id)]["revoked_at"]
    assert all("hashed" not in row for row in rows.values())
    assert revoked.hashed not in str(rows)
