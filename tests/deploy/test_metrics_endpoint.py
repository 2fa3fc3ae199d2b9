"""``/metrics`` answers only ``INTERNAL_API_ALLOWED_CIDRS`` (as ``/internal/`` does), whatever
the Host header and over plain HTTP; several uvicorn workers report one set of counters; the
Celery worker serves its task counters on ``WORKER_METRICS_PORT``, under the same rule."""

from __future__ import annotations

import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import test_database_url
from tests.livestack import LiveStack, answers, free_port, steep_env

ROOT = Path(__file__).resolve().parents[2]
CELERY = Path(sys.executable).with_name("celery")
# The loopback's other addresses are as local as 127.0.0.1: a caller from 127.0.0.2 is one
# from outside 127.0.0.1/32.
OUTSIDE = "127.0.0.2"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def get_from(address: str, url: str) -> httpx.Response:
    """GET ``url`` from the local ``address``."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30) as http:
        return http.get(url)


def assert_refused(response) -> None:
    assert response.status_code == 403, response.content
    assert response.json()["error"]["code"] == "internal_api_error"


@pytest.mark.django_db
def test_metrics_are_refused_from_outside_the_allowed_networks(client, settings):
    settings.INTERNAL_API_ALLOWED_CIDRS = ["10.0.0.0/8", "fd00::/8"]
    assert_refused(client.get("/metrics", REMOTE_ADDR="192.168.1.5"))
    for inside in ("10.1.2.3", "fd00::5"):
        response = client.get("/metrics", REMOTE_ADDR=inside)
        assert response.status_code == 200, response.content
        assert "steep_runs" in {
            family.name for family in text_string_to_metric_families(response.content.decode())
        }


@pytest.mark.django_db
def test_metrics_answer_a_scrape_by_address_over_plain_http(client, settings):
    """Prometheus scrapes a pod at its IP, over HTTP: neither ALLOWED_HOSTS nor the HTTPS
    redirect stand in the way (as for the health probes)."""
    settings.ALLOWED_HOSTS = ["steep.example.com"]
    settings.SECURE_SSL_REDIRECT = True
    response = client.get("/metrics", HTTP_HOST="10.4.0.7:8000")
    assert response.status_code == 200, response.content
    assert client.post("/metrics", HTTP_HOST="10.4.0.7:8000").status_code == 405


# --------------------------------------------------------------------- several web workers


@pytest.fixture(scope="module")
def two_workers(django_db_setup, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """uvicorn with two workers on the test database, answering /metrics to 127.0.0.1 only;
    its data directory holds a metrics directory left by a server that is gone."""
    data_dir = tmp_path_factory.mktemp("metrics-data")
    host = socket.gethostname().replace("-", "_")
    stale = data_dir / "metrics" / f"web-{host}-999999-1"
    stale.mkdir(parents=True)
    (stale / "counter_12.db").write_bytes(b"")
    env = steep_env(
        data_dir=data_dir,
        database_url=test_database_url(),
        INTERNAL_API_ALLOWED_CIDRS="127.0.0.1/32",
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with LiveStack(env=env, log_dir=tmp_path_factory.mktemp("two-workers")) as processes:
        web = processes.start_web(port, workers=2)
        probe = f"{url}/agents/{uuid.UUID(int=0)}/v1/models"
        processes.wait_ready(web, lambda: answers(probe, 401), what="uvicorn", timeout=120)
        yield url, data_dir


def test_several_web_workers_report_the_same_counters_in_every_scrape(two_workers):
    url, data_dir = two_workers
    start_session = f"{url}/agents/{uuid.uuid4()}/v1/rl/start_session"
    for _ in range(8):  # a connection each: the workers take turns accepting them
        response = httpx.post(start_session, headers={"Authorization": "Bearer sk-steep-no"})
        assert response.status_code == 401
    key = (
        "steep_gateway_requests_total",
        frozenset({"endpoint": "rl/start_session", "status": "401"}.items()),
    )
    for _ in range(4):  # whichever worker answers, it reads every worker's counts
        response = httpx.get(f"{url}/metrics", timeout=30)
        assert response.status_code == 200
        assert samples(response.text)[key] == 8

    directories = list((data_dir / "metrics").iterdir())
    assert len(directories) == 1 and directories[0].name.startswith("web-")  # the stale one went
    assert list(directories[0].glob("counter_*.db"))


def test_metrics_of_a_live_server_are_refused_from_outside_the_allowed_networks(two_workers):
    url, _ = two_workers
    assert_refused(get_from(OUTSIDE, f"{url}/metrics"))
    assert get_from("127.0.0.1", f"{url}/metrics").status_code == 200


# --------------------------------------------------------------------- the Celery worker


@pytest.fixture
def metrics_worker(subprocess_env, tmp_path) -> Iterator[tuple[str, LiveStack]]:
    """A Celery worker (a prefork pool of 2) serving its metrics, to 127.0.0.1 only."""
    port = free_port()
    env = subprocess_env | {
        "WORKER_METRICS_PORT": str(port),
        "INTERNAL_API_ALLOWED_CIDRS": "127.0.0.1/32",
        "RAY_ADDRESS": f"http://127.0.0.1:{free_port()}",  # never a Ray head from a test
    }
    command = [
        str(CELERY), "-A", "workers", "worker", "--pool=prefork", "--concurrency=2",
        "-Q", "celery", "--without-heartbeat", "--without-gossip", "--without-mingle", "-l", "info",
    ]  # fmt: skip
    with LiveStack(env=env, log_dir=tmp_path) as stack:
        worker = stack.start("worker", command)
        try:
            yield f"http://127.0.0.1:{port}", stack
        finally:
            stack.stop()
            host = socket.gethostname().replace("-", "_")
            for directory in (Path(env["DATA_DIR"]) / "metrics").glob(
                f"worker-{host}-{worker.pid}-*"
            ):
                shutil.rmtree(directory, ignore_errors=True)


def _worker_scrape(url: str) -> dict:
    try:
        response = httpx.get(f"{url}/metrics", timeout=5)
    except httpx.TransportError:  # not serving yet
        return {}
    assert response.status_code == 200, response.text
    return samples(response.text)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_worker_counts_its_tasks_on_its_metrics_port(metrics_worker):
    from webapp.gateway.tasks import sessions_expire_idle

    url, stack = metrics_worker
    sessions_expire_idle.delay()
    done = (
        "steep_worker_tasks_total",
        frozenset({"task": "sessions.expire_idle", "state": "SUCCESS"}.items()),
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and _worker_scrape(url).get(done) != 1:
        time.sleep(0.5)
    scraped = _worker_scrape(url)
    assert scraped.get(done) == 1, stack.log_tail()
    duration = (
        "steep_worker_task_duration_seconds_count",
        frozenset({"task": "sessions.expire_idle"}.items()),
    )
    assert scraped[duration] == 1

    assert_refused(get_from(OUTSIDE, f"{url}/metrics"))
    assert httpx.get(f"{url}/other", timeout=5).status_code == 404
