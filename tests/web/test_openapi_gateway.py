"""The API docs describe what an agent calls (the gateway) first, say which lists are paged,
and lead back to the dashboard. The schema is checked against the routes that really exist
and against what the endpoints really answer."""

from __future__ import annotations

import re

import pytest
import yaml
from django.urls import reverse

from webapp.gateway import urls as gateway_urls

pytestmark = pytest.mark.django_db

AGENT = "0b5e3c1e-9a0c-4d59-9d5e-3c1f6a1d2b7e"  # any well-formed id: no key gets past 401
METHODS = ("get", "post", "put", "patch", "delete")


@pytest.fixture
def schema(anon_api) -> dict:
    response = anon_api.get("/api/v1/schema/")
    assert response.status_code == 200
    return yaml.safe_load(response.content)


def _gateway_routes() -> list[str]:
    return [
        "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", str(pattern.pattern))
        for pattern in gateway_urls.urlpatterns
    ]


def _routed_methods(client, path: str) -> set[str]:
    """The methods the gateway answers on ``path`` with anything but 405."""
    url = path.replace("{agent_id}", AGENT)
    return {m for m in METHODS if getattr(client, m)(url).status_code != 405}


def _operations(item: dict) -> dict[str, dict]:
    return {method: op for method, op in item.items() if method in METHODS}


def test_every_gateway_route_is_documented_with_the_methods_it_routes(schema, client):
    routes = _gateway_routes()
    assert len(routes) >= 7
    for path in routes:
        assert path in schema["paths"], f"{path} (webapp.gateway.urls) is not in the schema"
        documented = set(_operations(schema["paths"][path]))
        assert documented == _routed_methods(client, path), path
    assert {"/agents/{agent_id}/v1/rl/start_session", "/agents/{agent_id}/v1/messages"} <= set(
        routes
    )


def test_gateway_is_listed_first(schema):
    assert schema["tags"][0]["name"] == "Agent gateway"
    assert "base_url" in schema["tags"][0]["description"]
    first = next(iter(schema["paths"].values()))
    assert next(iter(_operations(first).values()))["tags"] == ["Agent gateway"]


def test_every_gateway_operation_has_auth_a_body_and_its_errors(schema):
    schemes = schema["components"]["securitySchemes"]
    components = schema["components"]["schemas"]
    for path in _gateway_routes():
        for method, op in _operations(schema["paths"][path]).items():
            where = f"{method.upper()} {path}"
            assert op["security"], where
            for requirement in op["security"]:
                assert set(requirement) <= set(schemes), where
            codes = set(op["responses"])
            assert {"401", "404", "429"} <= codes, where
            if method == "post":
                assert {"400", "413"} <= codes, where
            assert "Retry-After" in op["responses"]["429"]["headers"], where
            for code, response in op["responses"].items():
                ref = response["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[1] in components, (where, code)
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                assert body["schema"]["$ref"].rsplit("/", 1)[1] in components, where


def test_messages_take_the_anthropic_header_and_answer_anthropic_errors(schema):
    op = schema["paths"]["/agents/{agent_id}/v1/messages"]["post"]
    schemes = schema["components"]["securitySchemes"]
    header_keys = [s for r in op["security"] for s in r if schemes[s].get("in") == "header"]
    assert [schemes[s]["name"] for s in header_keys] == ["x-api-key"]
    error = op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"]
    assert error.endswith("/AnthropicError")


def test_documented_errors_are_what_the_gateway_answers(schema, client):
    """Without a key every endpoint answers 401 in the shape its schema documents."""
    components = schema["components"]["schemas"]
    for path in _gateway_routes():
        for method, op in _operations(schema["paths"][path]).items():
            url = path.replace("{agent_id}", AGENT)
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is None:
                response = getattr(client, method)(url)
            else:  # the documented example: well-formed, so refused for the key alone
                example = components[body["schema"]["$ref"].rsplit("/", 1)[1]]["example"]
                response = client.post(url, example, content_type="application/json")
            assert response.status_code == 401, (method, path, response.content)
            documented = op["responses"]["401"]["content"]["application/json"]["schema"]
            shape = components[documented["$ref"].rsplit("/", 1)[1]]
            body = response.json()
            assert set(shape["required"]) <= set(body), (method, path, body)
            inner = shape["properties"]["error"]["required"]
            assert set(inner) <= set(body["error"]), (method, path, body)


def test_set_reward_body_documents_its_fields(schema):
    fields = schema["components"]["schemas"]["SetRewardInput"]
    assert fields["required"] == ["reward"]
    assert {"reward", "interaction_id", "hint"} <= set(fields["properties"])
    assert schema["paths"]["/agents/{agent_id}/v1/rl/start_session"]["post"]["responses"]["201"]


def _paged(op: dict) -> bool:
    ok = op["responses"].get("200", {}).get("content", {}).get("application/json", {})
    return ok.get("schema", {}).get("$ref", "").split("/")[-1].startswith("Paginated")


def test_paged_lists_say_so(schema):
    paged = [
        (path, op)
        for path, item in schema["paths"].items()
        for method, op in _operations(item).items()
        if method == "get" and _paged(op)
    ]
    assert "/api/v1/runs/{run_id}/metrics/" in [path for path, _ in paged]
    assert len(paged) >= 10
    for path, op in paged:
        assert "50 items a page" in op["description"], path
        assert "`next`" in op["description"] and "page_size" in op["description"], path
        assert {"page", "page_size"} <= {p["name"] for p in op["parameters"]}, path


def test_what_the_schema_calls_paged_is_what_the_api_pages(
    schema, api, client, owner, project, make_run
):
    """Every JSON GET list (with no other id than a run's): paged in the schema ⇔ paged in fact."""
    run = make_run(project)
    owner.is_staff = True  # pools are for staff sessions
    owner.save(update_fields=["is_staff"])
    client.force_login(owner)
    checked = 0
    for path, item in schema["paths"].items():
        op = item.get("get")
        if op is None or not path.startswith("/api/v1/"):
            continue
        if set(re.findall(r"{(\w+)}", path)) - {"run_id"}:
            continue
        if "application/json" not in op["responses"].get("200", {}).get("content", {}):
            continue
        url = path.replace("{run_id}", str(run.id))
        response = (client if path.startswith("/api/v1/pools/") else api).get(url)
        assert response.status_code == 200, (url, response.content[:200])
        body = response.json()
        is_page = isinstance(body, dict) and {"count", "next", "results"} <= set(body)
        assert is_page == _paged(op), path
        checked += 1
    assert checked >= 8


def test_docs_page_links_back_to_the_dashboard(anon_api, schema):
    html = anon_api.get("/api/v1/docs/").content.decode()
    home = reverse("dashboard:home")
    links = re.findall(r'<a [^>]*href="([^"]+)"[^>]*>([^<]*)</a>', html)
    assert (home, "← Dashboard") in links
    assert anon_api.get(home).status_code in (200, 302)
    assert f"]({home})" in schema["info"]["description"]  # also in the rendered description


def test_schema_is_valid_openapi(anon_api):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(anon_api.get("/api/v1/schema/?format=json").json())
