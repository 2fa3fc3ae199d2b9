"""Two projects' LoRA runs on one shared pool: one torch-engine process serves both, and each
run's adapter changes only its own agents' answers.

The pool's servers come from its own job (``workers.pool_job.run_pool`` on a local Ray
head: a replica actor in a placement group), registered over the internal API. The runs attach as their jobs do (``workers.job_api``: the pool's servers, then
``register_server``), publish their adapters with the job's ``AdapterSync`` from a real
LoRA trainer, and report the version over the internal API; the agents call the gateway
with the official ``openai`` SDK.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.localray import local_ray as local_ray_head
from webapp.gateway.models import InferenceServer, Session
from webapp.pools.models import Pool
from webapp.pools.services import pool_create, pool_job_secret_issue, pool_scale, pool_transition
from webapp.runs.jobs import job_secret_issue
from workers.job_api import InternalAPI, WebReporter

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def local_ray() -> Iterator[None]:
    """A Ray head of this test's own (2 CPUs); nothing of it outlives the test."""
    with local_ray_head("steep-ray-pool-", num_cpus=2):
        yield


@pytest.fixture
def pool_job(local_ray, gateway_url: str, tiny_model_dir: Path) -> Iterator[Pool]:
    """The pool's own job (``workers.pool_job``) keeping one LoRA-serving torch engine up as
    a Ray actor in its placement group; stopped as an operator stops it."""
    from workers.pool_job import run_pool

    pool = pool_create(
        name="shared",
        base_model=str(tiny_model_dir),
        backend="torch",
        max_lora_rank=8,
        max_loaded_adapters=4,
        start=False,
    )
    pool = pool_transition(pool=pool, to="starting")
    secret = pool_job_secret_issue(pool=pool)
    outcome: list = []
    job = threading.Thread(
        target=lambda: outcome.append(asyncio.run(run_pool(str(pool.id), gateway_url, secret)))
    )
    job.start()
    deadline = time.monotonic() + 240
    while not pool.servers.exists() and job.is_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    pool.refresh_from_db()
    assert pool.status == "running", pool.error
    try:
        yield pool
    finally:
        pool_transition(pool=pool, to="stopping")
        job.join(timeout=120)
        pool.refresh_from_db()
        assert outcome == ["stopped"] and pool.status == "stopped"
        assert not pool.servers.exists()


async def _attach(api: InternalAPI) -> None:
    """What an attached run's job does before serving: take the pool's servers as its own."""
    try:
        for server in await api.pool_servers(timeout_s=5):
            await api.register_server(server["url"], server["backend"])
    finally:
        await api.aclose()


async def _publish(api: InternalAPI, run, trainer, engine_url: str, adapters: Path, seed: int):
    """One "training step" of ``run``: a new adapter (random B) loaded as ``<run id>-v<N>`` on
    the pool's servers as they are now, wired as the run's job wires it."""
    import torch

    from rl_core.adapter_sync import AdapterSync

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    refresh, on_change = api.pool_hooks("torch")
    sync = AdapterSync(
        [engine_url], adapters, prefix=str(run.id), refresh=refresh, on_change=on_change
    )
    try:
        assert await sync.push(trainer) == trainer.version
        await WebReporter(api).version(trainer.version)  # what the loop reports after a step
    finally:
        await sync.aclose()
        await api.aclose()


def _wait_for_servers(pool: Pool, count: int) -> list[str]:
    deadline = time.monotonic() + 240
    while pool.servers.count() != count and time.monotonic() < deadline:
        time.sleep(0.5)
    return list(pool.servers.values_list("url", flat=True))


def test_two_projects_share_one_engine_and_each_adapter_changes_only_its_own_run(
    pool_job,
    gateway_url,
    tiny_model_dir,
    project,
    api_key,
    other_project,
    other_api_key,
    make_run,
    make_agent,
    set_status,
    tmp_path,
):
    from openai import NotFoundError, OpenAI

    from rl_core.trainer import PPOTrainer
    from tests.rl_core.test_trainer import _cfg

    (engine_url,) = pool_job.servers.values_list("url", flat=True)
    lora = {"base_model": str(tiny_model_dir), "lora_rank": 8, "lora_alpha": 16.0}
    teams = {}
    for name, owner, key in (("a", project, api_key), ("b", other_project, other_api_key)):
        run = set_status(make_run(owner, name=name, inference_pool="shared", **lora), "starting")
        secret = job_secret_issue(run=run)

        def api(run=run, secret=secret) -> InternalAPI:  # one client per event loop
            return InternalAPI(gateway_url, str(run.id), secret)

        asyncio.run(_attach(api()))
        run.refresh_from_db()
        assert run.status == "running"  # the pool's server made it serve
        agent = make_agent(owner, name=f"agent-{name}", run=run)
        client = OpenAI(
            base_url=f"{gateway_url}/agents/{agent.id}/v1", api_key=key, max_retries=0, timeout=60
        )
        teams[name] = (run, api, agent, client)

    def answer(name: str) -> tuple[str, str]:
        reply = teams[name][3].chat.completions.create(
            model="policy", messages=ASK, max_tokens=8, temperature=0
        )
        return reply.choices[0].message.content, reply.system_fingerprint

    base_a, base_b = answer("a"), answer("b")
    assert base_a == base_b and base_a[1] == "steep-v0"  # both on the base model

    trainer = PPOTrainer(_cfg(str(tiny_model_dir), lora_rank=8, lora_alpha=16.0))
    trainer.model.eval()
    trainer.version = 1
    run_a, api_a = teams["a"][:2]
    asyncio.run(_publish(api_a(), run_a, trainer, engine_url, tmp_path / "a", seed=11))
    tuned_a = answer("a")
    assert tuned_a[1] == "steep-v1" and tuned_a[0] != base_a[0]
    assert answer("b") == base_b  # run a's adapter is not run b's

    run_b, api_b = teams["b"][:2]
    asyncio.run(_publish(api_b(), run_b, trainer, engine_url, tmp_path / "b", seed=12))
    tuned_b = answer("b")
    assert tuned_b[1] == "steep-v1" and tuned_b[0] != base_b[0]
    assert answer("a") == tuned_a  # and run b's is not run a's

    # One engine process served every turn of both projects.
    assert set(Session.objects.values_list("server_url", flat=True)) == {engine_url}
    assert {str(run_a.id), str(run_b.id)} <= {
        name.rsplit("-v", 1)[0] for name in _loaded(engine_url)
    }
    # Project b's key cannot reach project a's agent.
    intruder = OpenAI(
        base_url=f"{gateway_url}/agents/{teams['a'][2].id}/v1",
        api_key=other_api_key,
        max_retries=0,
    )
    with pytest.raises(NotFoundError):
        intruder.chat.completions.create(model="policy", messages=ASK, max_tokens=2)

    # The operator scales the pool: run a's next step publishes to the new server too, and
    # only then is it one of run a's servers; run b keeps its one until its own next step.
    pool_scale(pool=pool_job, replicas=2)
    urls = _wait_for_servers(pool_job, 2)
    assert len(urls) == 2
    trainer.version = 2
    asyncio.run(_publish(api_a(), run_a, trainer, engine_url, tmp_path / "a", seed=13))
    served = InferenceServer.objects.filter(run=run_a).values_list("url", flat=True)
    assert sorted(served) == sorted(urls)
    assert list(InferenceServer.objects.filter(run=run_b).values_list("url", flat=True)) == [
        engine_url
    ]
    (new_url,) = set(urls) - {engine_url}
    assert f"{run_a.id}-v2" in _loaded(new_url) and not any(
        name.startswith(str(run_b.id)) for name in _loaded(new_url)
    )
    assert answer("a")[1] == "steep-v2"
    # Scaled back down: the server that leaves leaves every run's list.
    pool_scale(pool=pool_job, replicas=1)
    assert len(_wait_for_servers(pool_job, 1)) == 1
    assert InferenceServer.objects.filter(run=run_a).count() == 1
    for _, _, _, client in teams.values():
        client.close()
    intruder.close()


def _loaded(url: str) -> list[str]:
    """The adapters the engine has loaded (its load response lists them)."""
    import httpx

    response = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "none"}, timeout=30)
    return list(response.json().get("loaded_adapters", {}))
