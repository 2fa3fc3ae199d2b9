"""The internal API of a pool's job: its own secret, settings, servers, status and watch."""

from __future__ import annotations

import pytest

from webapp.pools.models import Pool
from webapp.pools.services import pool_job_secret_issue, pool_transition


@pytest.fixture
def pool(make_pool):
    pool = make_pool(name="shared", replicas=2, max_loaded_adapters=4)
    return pool_transition(pool=pool, to=Pool.Status.STARTING)


@pytest.fixture
def job(client, pool):
    secret = pool_job_secret_issue(pool=pool)

    def call(method: str, name: str, body=None, secret: str | None = secret):
        headers = {"HTTP_AUTHORIZATION": f"Bearer {secret}"} if secret else {}
        path = f"/internal/v1/pools/{pool.id}/{name}"
        if method == "GET":
            return client.get(path, **headers)
        return client.post(path, data=body or {}, content_type="application/json", **headers)

    call.secret = secret
    return call


def test_the_job_reads_its_pools_settings(job):
    body = job("GET", "config").json()
    assert (body["name"], body["replicas"], body["max_loaded_adapters"]) == ("shared", 2, 4)
    assert body["status"] == "starting"


def test_only_the_current_pool_secret_is_accepted(job, pool, api_key, project, make_run):
    from webapp.runs.jobs import job_secret_issue

    assert job("GET", "config", secret=None).status_code == 401
    assert job("GET", "config", secret=api_key).status_code == 401
    run = make_run(project)
    assert job("GET", "config", secret=job_secret_issue(run=run)).status_code == 401
    old = job.secret
    pool_job_secret_issue(pool=pool)
    assert job("GET", "config", secret=old).status_code == 401
    assert job("POST", "config").status_code == 405


def test_servers_register_and_the_pool_runs(job, pool):
    assert (
        job("POST", "servers", {"url": "http://10.0.0.1:30000", "backend": "sglang"}).status_code
        == 200
    )
    pool.refresh_from_db()
    assert pool.status == "running"
    assert list(pool.servers.values_list("url", flat=True)) == ["http://10.0.0.1:30000"]
    assert (
        job("POST", "servers", {"url": "http://10.0.0.1:30000", "action": "unregister"}).status_code
        == 200
    )
    assert not pool.servers.exists()


@pytest.mark.parametrize(
    "name, body",
    [
        ("servers", {"url": "ftp://x"}),
        ("servers", {"url": "http://x", "action": "explode"}),
        ("servers", {"url": "http://x", "backend": "tgi"}),
        ("status", {"status": "exploded"}),
        ("status", {"status": "failed", "error": 3}),
    ],
)
def test_bad_reports_are_400(job, name, body):
    assert job("POST", name, body).status_code == 400


def test_malformed_json_is_400(client, job, pool):
    response = client.post(
        f"/internal/v1/pools/{pool.id}/status",
        data="{nope",
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {job.secret}",
    )
    assert response.status_code == 400


def test_a_failed_job_fails_the_pool_with_its_error(job, pool):
    response = job("POST", "status", {"status": "failed", "error": "CUDA out of memory"})
    assert response.json() == {"status": "failed"}
    pool.refresh_from_db()
    assert (pool.status, pool.error) == ("failed", "CUDA out of memory")


def test_watch_answers_at_once_when_the_pool_was_scaled(job, pool):
    Pool.objects.filter(pk=pool.pk).update(replicas=5)
    body = job("GET", "watch?replicas=2&status=starting&wait_s=20").json()
    assert body == {"replicas": 5, "status": "starting", "run_weights": {}}


def test_watch_without_change_answers_the_same_after_its_wait(job):
    body = job("GET", "watch?replicas=2&status=starting&wait_s=0").json()
    assert body == {"replicas": 2, "status": "starting", "run_weights": {}}
    assert job("GET", "watch?replicas=two").status_code == 400
