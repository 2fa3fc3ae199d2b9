"""The staff page of pools: servers, attached runs of every project and their adapters."""

from __future__ import annotations

from django.test import Client

from webapp.pools.services import pool_server_register, pool_transition

LORA = {"base_model": "tiny-llama", "lora_rank": 8}


def staff_browser(staff) -> Client:
    browser = Client()
    browser.force_login(staff)
    return browser


def test_no_pool_is_an_empty_state_that_says_how_to_make_one(staff):
    page = staff_browser(staff).get("/pools/").content.decode()
    assert "No inference pools yet" in page and "pool_create" in page


def test_the_page_shows_servers_runs_and_adapters(
    staff, make_pool, project, other_project, make_run, set_status
):
    pool = pool_transition(pool=make_pool(name="shared", replicas=2), to="starting")
    pool_server_register(pool=pool, url="http://127.0.0.1:9", backend="torch")
    mine = set_status(make_run(project, name="mine", **LORA, inference_pool="shared"), "running")
    set_status(make_run(other_project, name="theirs", **LORA, inference_pool="shared"), "running")
    type(mine).objects.filter(pk=mine.pk).update(weight_version=3)
    page = staff_browser(staff).get("/pools/").content.decode()
    assert "shared" in page and "1 / 2" in page and "running" in page
    assert "acme / mine" in page and "rival / theirs" in page
    assert f"{mine.id}-v3" in page
    assert 'href="/pools/"' in page  # the nav link, for staff
    fragment = staff_browser(staff).get("/pools/", HTTP_HX_REQUEST="true").content.decode()
    assert fragment.startswith('<div id="pools-table"') and "acme / mine" in fragment


def test_members_who_are_not_staff_get_a_404_and_no_link(member_client, make_pool):
    make_pool(name="shared")
    assert member_client.get("/pools/").status_code == 404
    assert 'href="/pools/"' not in member_client.get("/projects/").content.decode()


def test_anonymous_visitors_are_sent_to_log_in(client):
    response = client.get("/pools/")
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_the_admin_lists_and_edits_pools(admin_client, make_pool):
    pool = make_pool(name="shared")
    assert "shared" in admin_client.get("/admin/pools/pool/").content.decode()
    assert admin_client.get(f"/admin/pools/pool/{pool.pk}/change/").status_code == 200
