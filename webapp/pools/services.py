"""Pools: creation, scaling, the lifecycle table, what the pool's job reports, and the rule
for which runs may attach.

Every status change of a pool goes through ``pool_transition``. Starting a pool queues
its Ray job (``webapp.pools.launching``) once the change is committed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from django.core.exceptions import ValidationError
from django.db import transaction

from rl_core.sources import SourceRefused, model_source
from webapp.accounts.keys import generate_key, hash_key
from webapp.observability import log_status
from webapp.pools.models import Pool, PoolServer
from webapp.runs.sources import source_rules

P = Pool.Status
JOB_SECRET_PREFIX = "steep-pool-"
# The highest replica count one call may ask for: a typo (1000) should not queue 1000 servers.
MAX_REPLICAS = 64

# running → starting: its job died after serving, and it is launched again (the reconciler).
TRANSITIONS: dict[str, set[str]] = {
    P.STOPPED: {P.STARTING},
    P.STARTING: {P.RUNNING, P.STOPPING, P.FAILED, P.INTERRUPTED},
    P.RUNNING: {P.STARTING, P.STOPPING, P.FAILED, P.INTERRUPTED},
    P.STOPPING: {P.STOPPED, P.FAILED},
    P.FAILED: {P.STARTING},
    P.INTERRUPTED: {P.STARTING, P.STOPPED},
}


class PoolInvalid(Exception):
    """The pool's settings are wrong; ``errors`` maps each field to its messages."""

    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))


class IllegalPoolTransition(Exception):
    def __init__(self, pool: Pool, target: str):
        allowed = ", ".join(sorted(TRANSITIONS[pool.status])) or "nothing"
        super().__init__(
            f"Pool '{pool.name}' is {pool.status}; it cannot become {target} "
            f"(from {pool.status} it can become: {allowed})."
        )


def pool_transition(
    *,
    pool: Pool,
    to: str,
    error: str = "",
    only_from: Collection[str] | None = None,
    job_id: str | None = None,
) -> Pool:
    """Move ``pool`` to ``to`` under a row lock, or raise ``IllegalPoolTransition``.
    ``only_from`` and ``job_id``: raise it too unless the locked row is still in one of these
    statuses and on this job (what the caller decided on)."""
    with transaction.atomic():
        locked = Pool.objects.select_for_update().get(pk=pool.pk)
        moved = (only_from is not None and locked.status not in only_from) or (
            job_id is not None and locked.job_id != job_id
        )
        if moved or to not in TRANSITIONS[locked.status]:
            raise IllegalPoolTransition(locked, to)
        locked.status = to
        fields = ["status", "updated_at"]
        if to in (P.FAILED, P.STARTING):
            locked.error = error
            fields.append("error")
        if to == P.STARTING:
            locked.job_id = ""  # a new job is submitted; the old one's servers are gone
            fields.append("job_id")
        locked.save(update_fields=fields)
        if to != P.RUNNING:
            _forget_servers(locked)
        transaction.on_commit(lambda: log_status("pool", locked.name, to, error))
    return locked


def _forget_servers(pool: Pool) -> None:
    """The pool's servers are gone (or going): no attached run routes to them any more."""
    from webapp.gateway.models import InferenceServer
    from webapp.runs.models import Run

    urls = list(PoolServer.objects.filter(pool=pool).values_list("url", flat=True))
    if urls:
        attached = Run.objects.filter(config__inference_pool=pool.name)
        InferenceServer.objects.filter(run__in=attached, url__in=urls).delete()
        PoolServer.objects.filter(pool=pool).delete()


def _check_replicas(replicas) -> list[str]:
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        return ["replicas must be a whole number."]
    if not 0 <= replicas <= MAX_REPLICAS:
        return [f"replicas must be between 0 and {MAX_REPLICAS} (0 keeps the pool with no server)."]
    return []


def pool_create(
    *,
    name: str,
    base_model: str,
    backend: str = Pool.Backend.AUTO,
    replicas: int = 1,
    tensor_parallel: int = 1,
    max_lora_rank: int = 64,
    lora_target_modules: Sequence[str] = (),
    max_loaded_adapters: int = 8,
    max_sessions_per_run: int = 0,
    max_requests_per_run: int = 0,
    start: bool = True,
    unrestricted: bool = False,
) -> Pool:
    """Create a pool (and start it unless ``start`` is false); ``PoolInvalid`` names each bad field.

    ``base_model`` must be a model the instance offers (``rl_core.sources``), as for a run,
    unless ``unrestricted`` (an operator's explicit bypass); it is stored as runs name it.
    """
    errors: dict[str, list[str]] = {}
    if isinstance(base_model, str) and base_model.strip():
        try:
            base_model = model_source(base_model, source_rules(unrestricted=unrestricted))
        except SourceRefused as exc:
            errors[exc.setting] = [str(exc)]
    if replica_errors := _check_replicas(replicas):
        errors["replicas"] = replica_errors
    modules = list(lora_target_modules)
    if not all(isinstance(m, str) and m for m in modules):
        errors["lora_target_modules"] = ["lora_target_modules is a list of module names."]
    pool = Pool(
        name=name,
        base_model=base_model.strip() if isinstance(base_model, str) else base_model,
        backend=backend,
        replicas=replicas if not errors.get("replicas") else 1,
        tensor_parallel=tensor_parallel,
        max_lora_rank=max_lora_rank,
        lora_target_modules=modules,
        max_loaded_adapters=max_loaded_adapters,
        max_sessions_per_run=max_sessions_per_run,
        max_requests_per_run=max_requests_per_run,
    )
    try:
        pool.full_clean()
    except ValidationError as exc:
        for field_name, messages in exc.message_dict.items():
            errors.setdefault(field_name, []).extend(messages)
    if errors:
        raise PoolInvalid(errors)
    pool.save()
    if start:
        pool = pool_start(pool=pool)
    return pool


def pool_start(
    *,
    pool: Pool,
    error: str = "",
    only_from: Collection[str] | None = None,
    job_id: str | None = None,
) -> Pool:
    """Queue the pool's job (stopped, failed, interrupted, or a running one whose job died:
    ``error`` says so); its servers come up in the background. ``only_from``, ``job_id``: as
    for ``pool_transition``."""
    pool = pool_transition(
        pool=pool, to=P.STARTING, error=error, only_from=only_from, job_id=job_id
    )

    def queue() -> None:
        from webapp.pools.tasks import pool_launch

        pool_launch.delay(str(pool.pk))

    transaction.on_commit(queue)
    return pool


def pool_stop(*, pool: Pool) -> Pool:
    """Ask the pool's job to stop its servers; a pool that never got a job is stopped at once."""
    pool = pool_transition(pool=pool, to=P.STOPPING)
    if not pool.job_id:
        return pool_transition(pool=pool, to=P.STOPPED)

    def queue() -> None:
        from webapp.pools.tasks import pool_shutdown

        pool_shutdown.delay(str(pool.pk))

    transaction.on_commit(queue)
    return pool


def pool_set_run_weights(*, pool: Pool, run_weights: dict) -> Pool:
    """Each attached run's weight in the servers' fair share of the batch (run id → weight;
    a run not named weighs 1); the pool's job passes them to its torch engine servers."""
    pool.run_weights = run_weights
    try:
        pool.clean()
    except ValidationError as exc:
        raise PoolInvalid(exc.message_dict) from None
    pool.save(update_fields=["run_weights", "updated_at"])
    return pool


def pool_scale(*, pool: Pool, replicas: int) -> Pool:
    """Set how many servers the pool runs; its job starts or stops servers to match."""
    if errors := _check_replicas(replicas):
        raise PoolInvalid({"replicas": errors})
    Pool.objects.filter(pk=pool.pk).update(replicas=replicas)
    pool.refresh_from_db()
    return pool


def pool_job_secret_issue(*, pool: Pool) -> str:
    """A fresh secret for the pool's new job; the previous job's stops working."""
    secret = generate_key(JOB_SECRET_PREFIX)
    Pool.objects.filter(pk=pool.pk).update(job_secret_hash=hash_key(secret))
    pool.refresh_from_db()
    return secret


def pool_job_submitted(*, pool: Pool, job_id: str) -> None:
    """The pool's job is on Ray: from now on the reconciler watches it (not before, or a job
    still being submitted would look like one that died)."""
    Pool.objects.filter(pk=pool.pk, status__in=[P.STARTING, P.RUNNING]).update(job_id=job_id)


def pool_job_authenticate(*, pool_id, token: str | None) -> Pool | None:
    if not token or not token.startswith(JOB_SECRET_PREFIX):
        return None
    return (
        Pool.objects.filter(pk=pool_id, job_secret_hash=hash_key(token))
        .exclude(job_secret_hash="")
        .first()
    )


def pool_server_register(*, pool: Pool, url: str, backend: str) -> PoolServer:
    """A server of the pool is healthy: attached runs use it from their next start (or step)."""
    server, _ = PoolServer.objects.update_or_create(
        pool=pool, url=url.rstrip("/"), defaults={"backend": backend}
    )
    pool.refresh_from_db()
    if pool.status == P.STARTING:
        pool_transition(pool=pool, to=P.RUNNING)
    return server


def pool_server_unregister(*, pool: Pool, url: str) -> None:
    """A server left the pool: it is no longer handed out, and no attached run routes to it."""
    from webapp.gateway.models import InferenceServer
    from webapp.runs.models import Run

    url = url.rstrip("/")
    with transaction.atomic():
        PoolServer.objects.filter(pool=pool, url=url).delete()
        attached = Run.objects.filter(config__inference_pool=pool.name)
        InferenceServer.objects.filter(run__in=attached, url=url).delete()


def pool_job_report_status(*, pool: Pool, status: str, error: str = "") -> Pool:
    """What the pool's job says of itself (running, stopped, failed); a repeat is a no-op."""
    pool.refresh_from_db()
    if pool.status == status:
        return pool
    if status == P.STOPPED and pool.status in (P.STARTING, P.RUNNING):
        pool = pool_transition(pool=pool, to=P.STOPPING)
    return pool_transition(pool=pool, to=status, error=error)
