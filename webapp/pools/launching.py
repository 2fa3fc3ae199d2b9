"""A pool's Ray job: submitting it (``pool_launch``) and stopping it (``pool_shutdown``).

What the Celery tasks in ``webapp.pools.tasks`` call; every status change goes through
``services.pool_transition``.
"""

from __future__ import annotations

import logging
import sys
import time

from django.conf import settings
from django.utils import timezone

from webapp.pools import services
from webapp.pools.models import Pool
from webapp.runs.launching import JOB_ENDED, LAUNCH_TIMEOUT, steep_cluster
from workers.ray_cluster import RayUnavailable, inference_pid_dir, job_status, stop_job, submit_job

logger = logging.getLogger(__name__)
P = Pool.Status


def pool_launch(*, pool_id: str) -> str:
    """Submit a starting pool's job with a fresh secret. Returns the job id, ``"skipped"``
    (gone, or no longer starting) or ``"failed"`` (the pool is then failed with the reason)."""
    pool = Pool.objects.filter(pk=pool_id).first()
    if pool is None or pool.status != P.STARTING:
        return "skipped"
    job_id = f"steep-pool-{pool.name}-{int(time.time())}"
    try:
        secret = services.pool_job_secret_issue(pool=pool)
        cluster = steep_cluster()
        env = {
            "STEEP_JOB_SECRET": secret,
            "PYTHONUNBUFFERED": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "STEEP_TORCH_THREADS": str(settings.STEEP_TORCH_THREADS),
            "STEEP_PLACEMENT_TIMEOUT_S": str(settings.STEEP_PLACEMENT_TIMEOUT_S),
        }
        if cluster.local:  # a stop of Steep finds the servers by these records
            env["STEEP_PID_DIR"] = str(inference_pid_dir(settings.DATA_DIR))
        entrypoint = [sys.executable, "-m", "workers.pool_job", "--pool-id", str(pool.pk)]
        submit_job(
            cluster,
            submission_id=job_id,
            entrypoint=entrypoint + ["--web-url", settings.INTERNAL_API_URL],
            env=env,
        )
        services.pool_job_submitted(pool=pool, job_id=job_id)
    except Exception as exc:
        logger.exception("launch of pool %s failed", pool.name)
        services.pool_transition(
            pool=pool, to=P.FAILED, error=f"Could not launch the pool: {type(exc).__name__}: {exc}"
        )
        return "failed"
    return job_id


def pool_shutdown(*, pool_id: str, grace_s: float = 60.0) -> str:
    """A stopping pool whose job has not reported ``stopped`` within ``grace_s`` is stopped by force."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        pool = Pool.objects.filter(pk=pool_id).first()
        if pool is None:
            return "missing"
        if pool.status != P.STOPPING:
            return pool.status
        time.sleep(1.0)
    if pool.job_id:
        stop_job(steep_cluster(), pool.job_id)
    services.pool_transition(pool=pool, to=P.STOPPED)
    return "stopped"


def pools_reconcile() -> dict:
    """Pools whose Ray job ended under them: one that was serving is launched again (its job
    holds no state), one that never served fails with the reason (a bad model would
    otherwise be retried forever). A launch that never got its job submitted fails too."""
    summary = {"relaunched": 0, "failed": 0}
    lost = Pool.objects.filter(
        status=P.STARTING, job_id="", updated_at__lt=timezone.now() - LAUNCH_TIMEOUT
    )
    for pool in lost:
        services.pool_transition(
            pool=pool, to=P.FAILED, error="The pool's job was never submitted (its worker died?)."
        )
        summary["failed"] += 1
    active = list(Pool.objects.filter(status__in=[P.STARTING, P.RUNNING]).exclude(job_id=""))
    if not active:
        return summary
    try:
        cluster = steep_cluster()
        states = {pool.pk: job_status(cluster, pool.job_id) for pool in active}
    except RayUnavailable as exc:  # no telling whether a job died: ask next time
        logger.warning("pool reconcile: %s", exc)
        return summary
    for pool in active:
        if states[pool.pk] in JOB_ENDED:
            outcome = pool_job_died(pool=pool, state=states[pool.pk])
            if outcome in summary:
                summary[outcome] += 1
    return summary


def pool_job_died(*, pool: Pool, state: str) -> str:
    """The pool's job ended (Ray says ``state``) under a starting or running pool. A pool that
    was serving is launched again (``"relaunched"``); one that never served fails
    (``"failed"``): a bad model or backend would otherwise be retried forever."""
    job_id = pool.job_id  # the job Ray was asked about
    pool.refresh_from_db()
    error = f"The pool's Ray job ended unexpectedly ({state})."
    # Under the row lock, only the status decided on and that job: a pass that read the pool
    # before another relaunched it leaves the new attempt alone.
    seen = (pool.status,)
    try:
        if pool.status == P.RUNNING:
            services.pool_start(pool=pool, error=error, only_from=seen, job_id=job_id)
            return "relaunched"
        services.pool_transition(pool=pool, to=P.FAILED, error=error, only_from=seen, job_id=job_id)
        return "failed"
    except services.IllegalPoolTransition:  # moved meanwhile
        return "skipped"


def pools_interrupt(*, stop_jobs: bool = False) -> list[str]:
    """Steep is stopping cleanly: starting and running pools become ``interrupted`` (a
    stopping one ``stopped``), their servers forgotten; with ``stop_jobs`` (an external
    ``RAY_ADDRESS`` cluster, which outlives Steep) their jobs are asked to stop. Returns the
    interrupted pools' names."""
    names, jobs = [], []
    for pool in Pool.objects.filter(status__in=[P.STARTING, P.RUNNING, P.STOPPING]):
        target = P.STOPPED if pool.status == P.STOPPING else P.INTERRUPTED
        try:
            pool = services.pool_transition(pool=pool, to=target)
        except services.IllegalPoolTransition:
            continue
        if pool.job_id:
            jobs.append(pool.job_id)
        if target == P.INTERRUPTED:
            names.append(pool.name)
    if stop_jobs and jobs:
        try:
            cluster = steep_cluster()
        except RayUnavailable:
            return names
        for job_id in jobs:
            stop_job(cluster, job_id)
    return names


def pools_resume() -> list[str]:
    """Start every ``interrupted`` pool again (at worker start-up); returns their names."""
    resumed = []
    for pool in Pool.objects.filter(status=P.INTERRUPTED):
        try:
            services.pool_start(pool=pool)
        except services.IllegalPoolTransition:
            continue
        resumed.append(pool.name)
    return resumed
