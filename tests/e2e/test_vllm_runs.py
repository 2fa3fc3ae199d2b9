"""Training runs on a real vLLM (its CPU build): REST → Celery → Ray job → vLLM + trainer.

A dataset run of full weights and one of LoRA, each with ``inference_backend: vllm``: the
job starts one vLLM server, every new version reaches it while it keeps serving (full weights
broadcast from the trainer over gloo into Steep's weight-transfer engine in vLLM, LoRA as an
adapter), so the versions its answers report rise through the run; nothing restarts it. The engine's logprobs agree with the
trainer's recomputation of the same tokens (``rollout/logprob_gap``, within ``GAP_BOUND``).
Needs ``./steep install --vllm``; CI sets ``STEEP_VLLM_CHECK=required``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rl_core.inference.vllm import vllm_available, vllm_python
from tests.e2e.test_training_runs import create_dataset_run, online_lora_run_played, run_state
from tests.livestack import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

if not vllm_available():
    if os.environ.get("STEEP_VLLM_CHECK") == "required":
        raise RuntimeError(f"vLLM is not installed at {vllm_python()}: ./steep install --vllm")
    pytest.skip(f"vLLM is not installed at {vllm_python()}", allow_module_level=True)

# float32 on both sides; vLLM's CPU kernels sum in another order than the trainer's: the
# mean per-token gap seen here was ~3e-6; the bound leaves room for other CPUs' kernels.
GAP_BOUND = 1e-3
STEPS = 6


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model at a head size vLLM's CPU attention supports (32)."""
    from rl_core.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.getbasetemp() / "tiny-vllm-chat", hidden=64, heads=2, kv_heads=1
    )


def served_versions(run_id: str) -> list[int]:
    """The versions vLLM reported for the tokens of each trained episode, in order."""
    from webapp.gateway.models import Interaction

    turns = Interaction.objects.filter(session__run_id=run_id).order_by("created_at")
    return [v for turn in turns for v in turn.outputs[0]["versions"]]


def run_on_vllm(rest, stack, vllm_model: Path, **settings) -> dict:
    run = create_dataset_run(
        rest,
        stack,
        base_model=str(vllm_model),
        inference_backend="vllm",
        max_steps=STEPS,
        save_every=STEPS,
        # On-policy: every batch is of the trainer's own version, so each step measures the
        # gap between vLLM's logprobs and the trainer's on the same weights.
        max_staleness=0,
        **settings,
    )
    assert rest.post(f"/runs/{run['id']}/start/").status_code == 202
    wait_for(
        lambda: run_state(rest, run["id"])["status"] in ("completed", "failed"),
        600,
        f"the run on vLLM to complete\n{stack.log_tail()}",
    )
    final = run_state(rest, run["id"])
    assert final["status"] == "completed", final.get("error")
    return final


def check_served_and_trained(final: dict) -> None:
    from webapp.runs.models import MetricPoint

    run_id = final["id"]
    servers = [e["message"] for e in final["events"] if e["kind"] == "server"]
    assert len(servers) == 1 and servers[0].startswith("vllm inference server up at"), servers
    assert not [e for e in final["events"] if e["kind"] == "inference"]  # no server restart
    versions = served_versions(run_id)
    # One vLLM process served every version: what it reported rose through the run.
    assert len(set(versions)) >= 3 and max(versions) >= STEPS - 2, sorted(set(versions))
    gaps = MetricPoint.objects.filter(run_id=run_id, name="rollout/logprob_gap")
    assert gaps.count() == STEPS
    assert all(0 <= point.value < GAP_BOUND for point in gaps), [p.value for p in gaps]
    worst = MetricPoint.objects.filter(run_id=run_id, name="rollout/logprob_gap_max")
    assert all(point.value < 10 * GAP_BOUND for point in worst), [p.value for p in worst]


def test_a_full_weight_run_on_vllm_broadcasts_each_version_into_the_running_server(
    stack, rest, vllm_model
):
    from webapp.runs.models import MetricPoint

    final = run_on_vllm(rest, stack, vllm_model)  # weight_sync: distributed, the default
    check_served_and_trained(final)
    fallbacks = [e["message"] for e in final["events"] if e["kind"] == "weight_sync"]
    assert fallbacks == []  # every version was broadcast: none fell back to disk
    from django.conf import settings

    assert not (Path(settings.DATA_DIR) / "runs" / final["id"] / "weights").exists()
    stalls = MetricPoint.objects.filter(run_id=final["id"], name="timing/inference_stall")
    assert stalls.count() == STEPS and all(point.value > 0 for point in stalls)
    sent = MetricPoint.objects.filter(run_id=final["id"], name="weight_sync/bytes")
    model_bytes = sum(f.stat().st_size for f in vllm_model.glob("*.safetensors"))
    assert all(point.value >= model_bytes * 0.9 for point in sent)  # the whole model, each time


def test_a_lora_run_on_vllm_serves_each_version_as_an_adapter(stack, rest, vllm_model):
    from webapp.runs.models import MetricPoint

    final = run_on_vllm(rest, stack, vllm_model, lora_rank=4, learning_rate=1e-2)
    check_served_and_trained(final)
    moved = MetricPoint.objects.filter(run_id=final["id"], name="weight_sync/bytes")
    model_bytes = sum(f.stat().st_size for f in vllm_model.glob("*.safetensors"))
    assert moved.count() == STEPS
    assert all(0 < point.value < model_bytes / 2 for point in moved)  # an adapter, not the model


def test_an_online_lora_run_on_a_vllm_pool_trains_while_agents_play(stack, rest, vllm_model):
    """A shared pool of one vLLM server (an operator's ``pool_create --backend vllm``) serves an
    online LoRA run: agents play through the gateway with the openai SDK while each new
    version is loaded into the pool's server as an adapter; the server is the pool's, never
    restarted, and the versions it answered with rose."""
    from webapp.gateway.models import Interaction, Session
    from webapp.pools.models import Pool, PoolServer
    from webapp.runs.models import MetricPoint

    said = stack.processes.manage(
        "pool_create", "vllm-pool", "--model", str(vllm_model), "--backend", "vllm",
        "--max-lora-rank", "8", "--max-loaded-adapters", "4",
    )  # fmt: skip
    assert "vllm-pool" in said, said
    try:
        pool = wait_for(
            lambda: Pool.objects.filter(name="vllm-pool", status="running").first(),
            600,
            f"the vLLM pool to serve\n{stack.log_tail()}",
        )
        (pool_url,) = PoolServer.objects.filter(pool=pool).values_list("url", flat=True)
        run, seen_versions, ended = online_lora_run_played(
            rest,
            stack,
            "online lora on a vllm pool",
            base_model=str(vllm_model),
            inference_pool="vllm-pool",
        )
        wait_for(
            lambda: run_state(rest, run["id"])["status"] == "completed",
            300,
            f"the run to complete\n{stack.log_tail()}",
        )
        assert len(seen_versions) > 1, seen_versions  # new adapters answered while agents played
        # Every turn was served by the pool's one vLLM server.
        turns = Interaction.objects.filter(session__run_id=run["id"])
        assert set(turns.values_list("server_url", flat=True)) == {pool_url}
        assert PoolServer.objects.filter(pool=pool).get().url == pool_url  # not restarted
        versions = served_versions(run["id"])
        assert max(versions) >= 1 and versions[-1] >= versions[0], sorted(set(versions))
        trained = Session.objects.filter(run_id=run["id"], trajectory="trained")
        assert trained.count() >= 4 and set(ended) >= {str(s.id) for s in trained}
        moved = MetricPoint.objects.filter(run_id=run["id"], name="weight_sync/bytes")
        model_bytes = sum(f.stat().st_size for f in vllm_model.glob("*.safetensors"))
        assert moved.count() == 3 and all(0 < p.value < model_bytes / 2 for p in moved)
    finally:  # the pool's job stops its vLLM server (the stack's teardown would too, later)
        from webapp.pools.services import pool_stop

        for pool in Pool.objects.filter(name="vllm-pool").exclude(status="stopped"):
            pool_stop(pool=pool)
        wait_for(
            lambda: Pool.objects.filter(name="vllm-pool", status="stopped").exists(),
            120,
            f"the vLLM pool to stop\n{stack.log_tail()}",
        )
