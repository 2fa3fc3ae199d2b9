"""The OpenAPI schema and its interactive docs are public and describe every endpoint."""

from __future__ import annotations

import re

import pytest
import yaml

from webapp.api import urls as api_urls

pytestmark = pytest.mark.django_db


@pytest.fixture
def schema(anon_api) -> dict:
    response = anon_api.get("/api/v1/schema/")
    assert response.status_code == 200
    return yaml.safe_load(response.content)


def test_schema_needs_no_auth_and_lists_every_path(schema):
    assert schema["openapi"].startswith("3.")
    assert schema["info"]["title"] == "Steep API"
    expected = set()
    for pattern in api_urls.urlpatterns:
        route = str(pattern.pattern)
        if route in {"schema/", "docs/"}:
            continue
        expected.add("/api/v1/" + route.replace("<str:", "{").replace(">", "}"))
    assert expected <= set(schema["paths"])
    assert "/api/v1/runs/{run_id}/start/" in schema["paths"]
    assert "/api/v1/schema/" not in schema["paths"]


def test_schema_documents_bearer_auth_and_run_settings(schema):
    schemes = schema["components"]["securitySchemes"]
    assert any(s.get("scheme") == "bearer" for s in schemes.values())
    create = schema["components"]["schemas"]["RunCreateInput"]["properties"]
    assert create["max_staleness"]["type"] == "integer"
    assert create["learning_rate"]["type"] == "number"
    assert create["use_decoupled_loss"]["type"] == "boolean"
    assert "policy versions" in create["max_staleness"]["description"]
    upload = schema["paths"]["/api/v1/datasets/"]["post"]["requestBody"]["content"]
    assert "multipart/form-data" in upload


def test_schema_as_json(anon_api):
    response = anon_api.get("/api/v1/schema/?format=json")
    assert response.status_code == 200
    assert "/api/v1/agents/" in response.json()["paths"]


def test_docs_page_renders_without_auth(anon_api):
    response = anon_api.get("/api/v1/docs/")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    assert b"/api/v1/schema/" in response.content


def test_docs_page_loads_swagger_ui_from_this_server_not_a_cdn(anon_api, client):
    html = anon_api.get("/api/v1/docs/").content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert not [a for a in assets if a.startswith(("http:", "https:", "//"))], assets
    bundle = next(a for a in assets if a.endswith("swagger-ui-bundle.js"))
    assert bundle.startswith("/static/drf_spectacular_sidecar/")
    assert client.get(bundle).status_code == 200


def test_schema_lists_every_run_status(schema):
    status = schema["components"]["schemas"]["RunOutput"]["properties"]["status"]
    if "$ref" in status:
        status = schema["components"]["schemas"][status["$ref"].rsplit("/", 1)[1]]
    elif "allOf" in status:
        status = schema["components"]["schemas"][status["allOf"][0]["$ref"].rsplit("/", 1)[1]]
    assert status["enum"] == [
        "draft", "queued", "starting", "running", "stopping",
        "stopped", "completed", "failed", "interrupted",
    ]  # fmt: skip
