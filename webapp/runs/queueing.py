"""Whether a queued run fits the Ray cluster now: its needs against what active runs and pools hold.

The worker asks this before it submits a run's job (``webapp.runs.launching.run_launch``).
The cluster's totals are the last ``ClusterReport``; what is held is counted from Steep's
own books, not asked of Ray: every active run holds its trainer workers and own servers, every
started pool its replicas (``workers.capacity`` sizes both). Counting is what lets the reason
name the holders ("pool shared holds 1"), and it is exact for a cluster only Steep uses;
anything else on the cluster is covered by the job's placement wait, as before. Before any
report nothing is known, and the run is launched.
"""

from __future__ import annotations

from collections.abc import Mapping

from rl_core.config import ConfigError, RunConfig
from webapp.pools.models import Pool
from webapp.runs.models import ClusterReport, Run
from workers.capacity import (
    CapacityError,
    resolve_backend,
    run_needs,
    server_resources,
    wait_reason,
)

HOLDING_RUNS = (Run.Status.STARTING, Run.Status.RUNNING, Run.Status.STOPPING)
HOLDING_POOLS = (Pool.Status.STARTING, Pool.Status.RUNNING, Pool.Status.STOPPING)
# Only what sizes a run, read as an online run's: a stored config also holds sealed secrets
# RunConfig would refuse, and a dataset run's reward, which sizes nothing.
SIZING_FIELDS = (
    "base_model",
    "train_workers",
    "num_inference_servers",
    "inference_pool",
    "inference_backend",
    "inference_tensor_parallel",
    "lora_rank",
)


def _sizing(run: Run) -> RunConfig | None:
    try:
        sizing = {k: run.config[k] for k in SIZING_FIELDS if k in run.config}
        return RunConfig.from_dict({**sizing, "mode": "online"})
    except ConfigError:
        return None


def _run_holds(run: Run, resources: Mapping[str, float], kind: str) -> float:
    config = _sizing(run)
    if config is None:
        return 0.0
    try:
        backend = resolve_backend(config.inference_backend, resources)
    except CapacityError:
        return 0.0
    needs = run_needs(config, backend, resources)
    return needs.total if needs.kind == kind else 0.0


def cluster_held(*, run: Run, resources: Mapping[str, float], kind: str) -> dict[str, float]:
    """What each active holder but ``run`` takes of ``kind``, by a name ``run``'s project may see:
    pools (the platform's) and its own project's runs by name, other projects' runs together."""
    held: dict[str, float] = {}
    for pool in Pool.objects.filter(status__in=HOLDING_POOLS).order_by("name"):
        try:
            backend = resolve_backend(pool.backend, resources)
        except CapacityError:
            continue
        server = server_resources(backend, resources, pool.tensor_parallel)
        held[f"pool {pool.name}"] = pool.replicas * server.get(kind, 0.0)
    others = 0.0
    active = Run.objects.filter(status__in=HOLDING_RUNS).exclude(pk=run.pk).order_by("created_at")
    for other in active:
        amount = _run_holds(other, resources, kind)
        if other.project_id == run.project_id:
            held[f"run '{other.name}'"] = amount
        else:
            others += amount
    if others:
        held["other projects' runs"] = others
    return held


def run_wait_reason(*, run: Run) -> str:
    """Why ``run`` cannot start on the cluster now, or ``""`` (it can, or nothing is known)."""
    report = ClusterReport.objects.first()
    config = _sizing(run)
    if report is None or config is None:
        return ""
    resources = {"GPU": report.gpus, "CPU": report.cpus}
    try:
        backend = resolve_backend(config.inference_backend, resources)
    except CapacityError:  # the job fails with this message
        return ""
    kind = run_needs(config, backend, resources).kind
    return wait_reason(
        config, backend, resources, cluster_held(run=run, resources=resources, kind=kind)
    )
