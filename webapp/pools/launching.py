"""A pool's Ray job: submitting it (``pool_launch``) and stopping it (``pool_shutdown``).

What the Celery tasks in ``webapp.pools.tasks`` call; every status change goes through
``services.pool_transition``.
"""

from __future__ import annotations

import logging
import sys
import time

from django.conf import settings

from webapp.pools import services
from webapp.pools.models import Pool
from webapp.runs.launching import steep_cluster
from workers.ray_cluster import inference_pid_dir, stop_job, submit_job

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
        secret = services.pool_job_secret_issue(pool=pool, job_id=job_id)
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
