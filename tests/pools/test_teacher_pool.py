"""A shared inference pool as a run's teacher (issue 38: "the teacher is a model Steep serves"):
named by ``teacher_pool``, checked when the run is created, described to the job by the internal
API, and scoring through its servers (a real torch engine) exactly as a full forward does."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.testing import assert_close

from rl_core.config import RunConfig
from rl_core.distill import TeacherError, connect_teacher
from rl_core.types import Trajectory
from tests.rl_core.conftest import reference, torch_engine, torch_engine_factory  # noqa: F401
from webapp.pools.models import PoolServer
from webapp.runs.jobs import job_secret_issue

pytestmark = pytest.mark.django_db

IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]


def test_a_run_naming_a_pool_that_does_not_exist_is_refused(api, api_error, make_pool):
    make_pool("teachers")
    payload = {"name": "student", "mode": "online", "base_model": "tiny-llama"}
    error = api_error(
        api.post("/api/v1/runs/", payload | {"teacher_pool": "nope"}, format="json"), 400
    )
    assert "No inference pool is named 'nope'" in str(error)
    both = payload | {"teacher_pool": "teachers", "teacher_url": "http://127.0.0.1:1"}
    assert "teacher_pool" in str(api_error(api.post("/api/v1/runs/", both, format="json"), 400))
    ok = api.post("/api/v1/runs/", payload | {"teacher_pool": "teachers"}, format="json")
    assert ok.status_code == 201, ok.content


def test_the_job_learns_the_pools_servers_and_model(client, project, make_run, make_pool):
    pool = make_pool("teachers")
    PoolServer.objects.create(pool=pool, url="http://127.0.0.1:30001", backend="torch")
    taught, untaught = make_run(project, teacher_pool="teachers"), make_run(project, name="b")

    def get(run):
        return client.get(
            f"/internal/v1/runs/{run.id}/teacher_pool",
            HTTP_AUTHORIZATION=f"Bearer {job_secret_issue(run=run)}",
        )

    assert get(taught).json() == {
        "name": "teachers",
        "status": "stopped",
        "base_model": pool.base_model,
        "servers": [{"url": "http://127.0.0.1:30001", "backend": "torch"}],
    }
    assert get(untaught).status_code == 404


def test_a_pool_teacher_scores_through_its_servers_and_finds_a_restarted_one(
    torch_engine,  # noqa: F811
    tiny_model_dir,
    reference,  # noqa: F811
):
    cfg = RunConfig.from_dict(
        {"base_model": str(tiny_model_dir), "mode": "online", "teacher_pool": "teachers"}
    )
    live = {"url": torch_engine.url, "backend": "torch"}
    # The job was told of a server that has since gone; looking the pool up again finds the
    # one that serves now.
    pool = {"name": "teachers", "base_model": str(tiny_model_dir), "servers": [live]}
    stale = pool | {"servers": [{"url": "http://127.0.0.1:9", "backend": "torch"}]}
    lookups = []

    async def lookup() -> dict:
        lookups.append(1)
        return pool

    async def go():
        scorer = await connect_teacher(cfg, pool=stale, pool_lookup=lookup)
        assert scorer is not None
        scorer.backoff_s = 0.05
        traj = Trajectory(IDS, [0] + [1] * 9, [0.0] + [-1.0] * 9, [-1] + [0] * 9, [1.0])
        try:
            metrics = await scorer.score([traj])
        finally:
            await scorer.aclose()
        return traj, metrics

    traj, metrics = asyncio.run(go())
    assert lookups == [1] and metrics["distill/teacher_retries"] == 1.0
    want = reference.logprobs(tiny_model_dir, IDS[:1], IDS[1:])
    assert_close(torch.tensor(traj.teacher_logprobs[1:]), want, atol=1e-4, rtol=0)


def test_a_pool_whose_model_has_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(other)
    cfg = RunConfig.from_dict(
        {"base_model": str(tiny_model_dir), "mode": "online", "teacher_pool": "teachers"}
    )
    pool = {
        "name": "teachers",
        "base_model": str(other),
        "servers": [{"url": "http://127.0.0.1:9", "backend": "torch"}],
    }
    with pytest.raises(TeacherError, match="must share one tokenizer") as refused:
        asyncio.run(connect_teacher(cfg, pool=pool))
    assert str(other) in str(refused.value) and str(tiny_model_dir) in str(refused.value)
