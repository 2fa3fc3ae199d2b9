"""Bad requests get a 4xx in the error shape; nothing a client sends produces a 500."""

from __future__ import annotations

import pytest

from webapp.agents.models import Agent
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db

POST_JSON = ["/api/v1/runs/", "/api/v1/agents/", "/api/v1/keys/"]


@pytest.mark.parametrize("path", POST_JSON)
def test_malformed_json_is_400(api, api_error, path):
    response = api.post(path, data='{"name": "x",', content_type="application/json")
    assert api_error(response, 400)["code"] == "parse_error"


@pytest.mark.parametrize("path", POST_JSON)
def test_a_json_array_body_is_400(api, api_error, path):
    response = api.post(path, data='[{"name": "x"}]', content_type="application/json")
    api_error(response, 400)
    assert not Run.objects.exists() and not Agent.objects.exists()


@pytest.mark.parametrize("body", ['"just a string"', "42", "null", "true"])
def test_a_json_scalar_body_is_400(api, api_error, body):
    api_error(api.post("/api/v1/runs/", data=body, content_type="application/json"), 400)


@pytest.mark.parametrize("setting", ["seed", "top_p", "max_steps"])
def test_a_number_too_large_for_a_float_is_400(api, api_error, setting):
    body = '{"name": "r", "mode": "online", "base_model": "m", "SETTING": 1e400}'
    body = body.replace("SETTING", setting)
    error = api_error(api.post("/api/v1/runs/", data=body, content_type="application/json"), 400)
    assert setting in error["fields"]


def test_nan_is_not_json(api, api_error):
    body = '{"name": "r", "mode": "online", "base_model": "m", "learning_rate": NaN}'
    api_error(api.post("/api/v1/runs/", data=body, content_type="application/json"), 400)
    assert not Run.objects.exists()


def test_form_encoded_body_is_415(api, api_error):
    api_error(api.post("/api/v1/runs/", {"name": "r"}), 415)


def test_body_over_max_request_bytes_is_413(api, settings, api_error):
    settings.MAX_REQUEST_BYTES = 1024
    payload = {"name": "r", "mode": "online", "base_model": "m" * 2000}
    error = api_error(api.post("/api/v1/runs/", payload, format="json"), 413)
    assert error["code"] == "request_too_large" and "1024" in error["message"]
    assert not Run.objects.exists()


def test_body_under_max_request_bytes_is_accepted(api, settings):
    settings.MAX_REQUEST_BYTES = 1024
    response = api.post(
        "/api/v1/runs/", {"name": "r", "mode": "online", "base_model": "m"}, format="json"
    )
    assert response.status_code == 201


@pytest.mark.parametrize(
    "path,payload",
    [
        ("/api/v1/runs/", {"name": None, "mode": "online", "base_model": "m"}),
        ("/api/v1/runs/", {"name": ["r"], "mode": "online", "base_model": "m"}),
        ("/api/v1/runs/", {"name": "r" * 500, "mode": "online", "base_model": "m"}),
        ("/api/v1/runs/", {"name": "r", "mode": ["online"], "base_model": "m"}),
        ("/api/v1/runs/", {"name": "r", "mode": "online", "base_model": {"a": 1}}),
        ("/api/v1/runs/", {"name": "r", "mode": "online", "base_model": "m", "reward": []}),
        ("/api/v1/runs/", {"name": "r", "mode": "dataset", "base_model": "m", "dataset": 7}),
        ("/api/v1/runs/", {"name": "r", "mode": "dataset", "base_model": "m", "dataset": {}}),
        ("/api/v1/runs/", {"name": "r", "mode": "online", "base_model": "m", "config": {}}),
        ("/api/v1/runs/", {}),
        ("/api/v1/agents/", {"name": "a", "run": "not-a-uuid"}),
        ("/api/v1/agents/", {"name": "a", "run": []}),
        ("/api/v1/agents/", {"name": ""}),
        ("/api/v1/agents/", {}),
        ("/api/v1/keys/", {"name": "k" * 500}),
        ("/api/v1/keys/", {"expires_at": "yesterday"}),
        ("/api/v1/keys/", {"expires_at": 12}),
    ],
)
def test_bad_input_is_a_400_never_a_500(api, api_error, path, payload):
    api_error(api.post(path, payload, format="json"), 400)


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/runs/?page=0",
        "/api/v1/runs/?page=abc",
        "/api/v1/runs/?page=999",
        "/api/v1/agents/?run=not-a-uuid",
    ],
)
def test_bad_query_parameters_are_4xx_never_500(api, path):
    response = api.get(path)
    assert 400 <= response.status_code < 500
    assert set(response.json()) == {"error"}


def test_unsupported_method_is_405(api, api_error):
    api_error(api.put("/api/v1/runs/", {}, format="json"), 405)
    api_error(api.get("/api/v1/keys/00000000-0000-0000-0000-000000000000/"), 405)


@pytest.mark.parametrize(
    "method,path",
    [
        ("get", "/api/v1/project/"),
        ("get", "/api/v1/keys/"),
        ("post", "/api/v1/keys/"),
        ("get", "/api/v1/datasets/"),
        ("post", "/api/v1/datasets/"),
        ("get", "/api/v1/runs/"),
        ("post", "/api/v1/runs/"),
        ("get", "/api/v1/agents/"),
        ("post", "/api/v1/agents/"),
        ("get", "/api/v1/runs/00000000-0000-0000-0000-000000000000/"),
        ("post", "/api/v1/runs/00000000-0000-0000-0000-000000000000/start/"),
        ("get", "/api/v1/runs/00000000-0000-0000-0000-000000000000/metrics/"),
        ("delete", "/api/v1/datasets/00000000-0000-0000-0000-000000000000/"),
        ("post", "/api/v1/keys/00000000-0000-0000-0000-000000000000/revoke/"),
    ],
)
def test_unauthenticated_is_401(anon_api, api_error, method, path):
    response = getattr(anon_api, method)(path)
    assert api_error(response, 401)["code"] == "not_authenticated"
    assert response["WWW-Authenticate"] == "Bearer"


def test_a_huge_integer_setting_is_not_a_500(api):
    body = '{"name": "r", "mode": "online", "base_model": "m", "seed": ' + str(10**30) + "}"
    response = api.post("/api/v1/runs/", data=body, content_type="application/json")
    assert response.status_code in (201, 400)
