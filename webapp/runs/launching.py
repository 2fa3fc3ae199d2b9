"""A run's Ray job: submitting it, stopping it, and noticing when it died.

What the Celery tasks in ``webapp.runs.tasks`` call. The Ray side (the cluster, the Jobs
API) is ``workers.ray_cluster``; every status change goes through ``run_transition``.
"""

from __future__ import annotations

import logging
import sys
import time

from django.conf import settings

from webapp.gateway.models import InferenceServer
from webapp.runs.jobs import job_release, job_secret_issue
from webapp.runs.models import Run, RunEvent
from webapp.runs.services import IllegalTransition, run_queue, run_transition
from workers.ray_cluster import (
    RayCluster,
    RayUnavailable,
    ensure_cluster,
    job_logs_tail,
    job_status,
    stop_job,
    submit_job,
)

logger = logging.getLogger(__name__)

S = Run.Status
JOB_ENDED = ("STOPPED", "SUCCEEDED", "FAILED", "MISSING")


def _cluster() -> RayCluster:
    return ensure_cluster(
        data_dir=settings.DATA_DIR,
        address=settings.RAY_ADDRESS,
        num_cpus=settings.RAY_NUM_CPUS or None,
        dashboard_port=settings.RAY_LOCAL_DASHBOARD_PORT,
        gcs_port=settings.RAY_LOCAL_GCS_PORT,
    )


def _submit(run: Run) -> str:
    run = run_transition(run=run, to=S.STARTING, message="A worker is submitting the run to Ray.")
    InferenceServer.objects.filter(run=run).delete()  # servers of a previous attempt are gone
    job_release(run=run)
    secret = job_secret_issue(run=run)
    job_id = f"steep-run-{run.id.hex[:12]}-a{run.job_attempt}-{int(time.time())}"
    env = {
        "STEEP_JOB_SECRET": secret,
        "PYTHONUNBUFFERED": "1",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "STEEP_TORCH_THREADS": str(settings.STEEP_TORCH_THREADS),
    }
    entrypoint = [
        sys.executable,
        "-m",
        "workers.ray_job",
        "--run-id",
        str(run.id),
        "--web-url",
        settings.INTERNAL_API_URL,
    ]
    submit_job(
        _cluster(),
        submission_id=job_id,
        entrypoint=entrypoint,
        env=env,
        num_gpus=settings.RAY_JOB_NUM_GPUS,
    )
    Run.objects.filter(pk=run.pk).update(job_id=job_id)
    RunEvent.objects.create(
        run=run, kind="launch", message=f"Submitted Ray job {job_id} (attempt {run.job_attempt})."
    )
    return job_id


def run_launch(*, run_id: str) -> str:
    """Submit a queued run as a Ray job with a fresh job secret; the run becomes ``starting``.

    Returns the job id, ``"skipped"`` when the run is gone or no longer queued, or
    ``"failed"`` when the submission failed: the run is then ``failed`` with the reason.
    """
    run = Run.objects.filter(pk=run_id).first()
    if run is None or run.status != S.QUEUED:
        return "skipped"
    try:
        return _submit(run)
    except IllegalTransition as exc:  # stopped or launched by someone else meanwhile
        logger.info("launch of %s skipped: %s", run_id, exc)
        return "skipped"
    except Exception as exc:  # whatever broke (Ray unreachable, a refused job), the run says why
        logger.exception("launch of %s failed", run_id)
        run.refresh_from_db()
        if run.status in (S.QUEUED, S.STARTING):
            run_transition(
                run=run, to=S.FAILED, error=f"Could not launch the run: {type(exc).__name__}: {exc}"
            )
        return "failed"


def run_shutdown(*, run_id: str, grace_s: float = 120.0) -> str:
    """Finish a stop request: the job checkpoints and reports ``stopped``; after ``grace_s`` it is stopped by force.

    Returns the run's status when something else settled it first, else ``"stopped"``.
    """
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return "missing"
    deadline = time.monotonic() + grace_s
    while run.job_id and time.monotonic() < deadline:
        run.refresh_from_db()
        if run.status != S.STOPPING:
            return run.status
        if job_status(_cluster(), run.job_id) in JOB_ENDED:
            break
        time.sleep(1.0)
    run.refresh_from_db()
    if run.status != S.STOPPING:
        return run.status
    if run.job_id:
        stop_job(_cluster(), run.job_id)
    try:
        run_transition(run=run, to=S.STOPPED, message="Stopped by the worker.")
    except IllegalTransition:
        pass
    return "stopped"


def runs_reconcile() -> dict:
    """Find runs whose Ray job died (worker restart, reboot, crash): mark them failed and queue
    them again from their last checkpoint, at most ``RUN_MAX_RESTARTS`` times."""
    summary = {"restarted": 0, "failed": 0}
    active = Run.objects.filter(status__in=[S.STARTING, S.RUNNING]).exclude(job_id="")
    if not active.exists():
        return summary
    try:
        cluster = _cluster()
    except RayUnavailable as exc:
        logger.warning("reconcile: Ray unavailable: %s", exc)
        return summary
    for run in active:
        state = job_status(cluster, run.job_id)
        if state in ("PENDING", "RUNNING"):
            continue
        run.refresh_from_db()
        if run.status not in (S.STARTING, S.RUNNING):
            continue
        tail = job_logs_tail(cluster, run.job_id)
        Run.objects.filter(pk=run.pk).update(job_log_tail=tail)
        released = job_release(run=run)
        try:
            run = run_transition(
                run=run,
                to=S.FAILED,
                error=f"The run's Ray job ended unexpectedly ({state}).\n\n{tail}",
            )
        except IllegalTransition:
            continue
        if run.job_attempt <= settings.RUN_MAX_RESTARTS:
            RunEvent.objects.create(
                run=run,
                kind="reconcile",
                message=f"Job {state}; released {released} trajectories; restarting from the last checkpoint.",
            )
            run_queue(run=run, message="Restarted by the reconciler.")
            summary["restarted"] += 1
        else:
            summary["failed"] += 1
    return summary
