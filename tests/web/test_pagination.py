"""Every list endpoint pages the same way: count, next, previous, results; ?page_size= works."""

from __future__ import annotations

import pytest

from webapp.accounts.services import api_key_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def seven_of_each(project, make_dataset, make_run, make_agent):
    for i in range(7):
        make_dataset(project, name=f"d{i}")
        make_run(project, name=f"r{i}")
        make_agent(project, name=f"a{i}")
    for i in range(6):  # plus the fixture's own key
        api_key_create(project=project, name=f"k{i}")


@pytest.mark.parametrize("name", ["datasets", "runs", "agents", "keys"])
def test_lists_page_with_count_next_previous_results(api, seven_of_each, name):
    first = api.get(f"/api/v1/{name}/?page_size=3")
    assert first.status_code == 200
    body = first.json()
    assert set(body) == {"count", "next", "previous", "results"}
    assert body["count"] == 7 and len(body["results"]) == 3
    assert body["previous"] is None
    assert body["next"].startswith("http://testserver/api/v1/") and "page=2" in body["next"]

    last = api.get(f"/api/v1/{name}/?page_size=3&page=3").json()
    assert len(last["results"]) == 1 and last["next"] is None and "page_size=3" in last["previous"]

    seen = []
    for page in (1, 2, 3):
        seen += [
            r["id"] for r in api.get(f"/api/v1/{name}/?page_size=3&page={page}").json()["results"]
        ]
    assert len(seen) == len(set(seen)) == 7


@pytest.mark.parametrize("name", ["datasets", "runs", "agents", "keys"])
def test_lists_default_to_one_page_of_everything_small(api, seven_of_each, name):
    body = api.get(f"/api/v1/{name}/").json()
    assert body["count"] == 7 and len(body["results"]) == 7 and body["next"] is None


def test_lists_are_newest_first(api, seven_of_each):
    names = [r["name"] for r in api.get("/api/v1/runs/").json()["results"]]
    assert names == [f"r{i}" for i in reversed(range(7))]


def test_page_size_is_capped(api, project, make_agent):
    for i in range(3):
        make_agent(project, name=f"a{i}")
    body = api.get("/api/v1/agents/?page_size=100000").json()
    assert body["count"] == 3 and len(body["results"]) == 3


def test_a_page_past_the_end_is_404(api, api_error, seven_of_each):
    api_error(api.get("/api/v1/runs/?page_size=3&page=4"), 404)
