"""Reads of pools: listing, the servers a run attached to a pool uses, the attach rule, stats.

Pools are the platform's, not a project's: these reads are for staff views and for the
internal API. A project sees nothing of a pool through its key (``apis``).
"""

from __future__ import annotations

from django.db.models import Count, QuerySet

from rl_core.config import LORA_ALL_LINEAR, RunConfig
from webapp.pools.models import Pool, PoolServer
from webapp.runs.models import Run

ATTACHED_ACTIVE = (
    Run.Status.QUEUED,
    Run.Status.STARTING,
    Run.Status.RUNNING,
    Run.Status.STOPPING,
)


def pool_list() -> QuerySet[Pool]:
    return Pool.objects.annotate(server_count=Count("servers")).order_by("name")


def pool_get(*, name: str) -> Pool | None:
    return Pool.objects.filter(name=name).first()


def pool_server_urls(*, pool: Pool) -> list[str]:
    return list(PoolServer.objects.filter(pool=pool).values_list("url", flat=True))


def pool_runs(*, pool: Pool, active_only: bool = True) -> QuerySet[Run]:
    """The runs (of any project) attached to ``pool``; staff reads only."""
    runs = Run.objects.filter(config__inference_pool=pool.name).select_related("project")
    if active_only:
        runs = runs.filter(status__in=ATTACHED_ACTIVE)
    return runs.order_by("created_at")


def pool_attach_errors(*, config: RunConfig) -> dict[str, list[str]]:
    """Why a run with ``config`` cannot attach to the pool it names (empty: it can, or names none).

    The pool must exist and serve the run's base model, at the run's LoRA rank, on the
    modules its adapter targets; a full-weight run is refused by ``RunConfig`` itself.
    """
    name = config.inference_pool
    if not name:
        return {}
    pool = pool_get(name=name)
    if pool is None:
        return {
            "inference_pool": [
                f"No inference pool is named '{name}'. Pick one of the pools your operators "
                "created (./steep manage pool_list), or leave inference_pool empty for servers "
                "of the run's own."
            ]
        }
    errors = []
    if pool.base_model != config.base_model:
        errors.append(
            f"Pool '{name}' serves {pool.base_model}, not {config.base_model}: set base_model "
            "to the pool's, or pick a pool that serves yours."
        )
    if config.lora_rank > pool.max_lora_rank:
        errors.append(
            f"Pool '{name}' serves adapters up to rank {pool.max_lora_rank}; set lora_rank "
            f"to {pool.max_lora_rank} or less."
        )
    served = set(pool.lora_target_modules)
    wanted = set(config.lora_target_modules) - {LORA_ALL_LINEAR}
    if served and (not wanted or not wanted <= served):
        errors.append(
            f"Pool '{name}' serves adapters on {sorted(served)} only; set lora_target_modules "
            "to some of those."
        )
    return {"inference_pool": errors} if errors else {}


def teacher_pool_errors(*, config: RunConfig) -> dict[str, list[str]]:
    """Why ``config``'s ``teacher_pool`` cannot teach it (empty: it can, or names none); its
    tokenizer is checked against the student's when the run's job starts."""
    name = config.teacher_pool
    if not name or pool_get(name=name) is not None:
        return {}
    return {
        "teacher_pool": [
            f"No inference pool is named '{name}'. Pick one of the pools your operators created "
            "(./steep manage pool_list), or name the teacher's server in teacher_url."
        ]
    }


def pool_stats(*, pool: Pool) -> dict:
    """What the pool page and the REST detail show: servers, attached runs with their adapter,
    tokens/s and queue depth, and the adapters the servers hold (``serving``)."""
    from rl_core.inference.adapters import current_adapter, role_prefix
    from webapp.pools import serving

    urls = pool_server_urls(pool=pool)
    states = serving.server_states(urls)
    reporting = [s for s in states.values() if s is not None]
    figures = serving.per_run(states)
    runs = []
    for run in pool_runs(pool=pool):
        # A multi-agent run serves one adapter per role (``<run>-<role>-v<N>``).
        prefixes = {
            role: role_prefix(str(run.id), role) for role in run.config.get("roles") or [""]
        }
        adapters = {
            role: current_adapter(
                prefix,
                run.weight_version,
                lora_rank=int(run.config.get("lora_rank") or 0),
                init_checkpoint=run.config.get("init_checkpoint") or None,
            )
            for role, prefix in prefixes.items()
        }
        adapter = (
            adapters.pop("", None) if "" in adapters else ", ".join(map(str, adapters.values()))
        )
        load = {"running_requests": 0, "queue_depth": 0, "tokens_per_s": 0.0}
        # The torch engine counts a multi-agent run's roles as the run (its fair-share tenant).
        for prefix in {str(run.id), *prefixes.values()}:
            for name, value in figures.get(prefix, {}).items():
                load[name] += value
        runs.append(
            {
                "run_id": str(run.id),
                "run_name": run.name,
                "project": run.project.name,
                "status": run.status,
                "weight_version": run.weight_version,
                "adapter": adapter,
                "role_adapters": adapters,  # role → adapter; {} for a one-policy run
                "sessions_open": run.sessions_open,
                # None: no server reports per-run figures (SGLang, or none up)
                **(load if reporting else dict.fromkeys(load)),
            }
        )
    return {
        "servers": urls,
        "servers_reporting": len(reporting),
        "runs": runs,
        "loaded_adapters": sorted({a for s in reporting for a in s.get("loaded_adapters", [])}),
        "evicted_adapters": sorted({a for s in reporting for a in s.get("evicted_adapters", [])}),
    }
