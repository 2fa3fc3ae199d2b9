"""Run lifecycle tasks. Each takes ids, loads objects and calls services; Ray talk goes through workers.ray_cluster."""

from __future__ import annotations

import logging
import sys
import time

from celery import shared_task

logger = logging.getLogger(__name__)


def _cluster():
    from django.conf import settings

    from workers.ray_cluster import ensure_cluster

    return ensure_cluster(
        data_dir=settings.DATA_DIR,
        address=settings.RAY_ADDRESS,
        num_cpus=settings.RAY_NUM_CPUS or None,
        dashboard_port=settings.RAY_LOCAL_DASHBOARD_PORT,
        gcs_port=settings.RAY_LOCAL_GCS_PORT,
    )


def launch(run) -> str:
    """Submit ``run`` (queued) as a Ray job with a fresh job secret; the run becomes ``starting``."""
    from django.conf import settings

    from webapp.gateway.models import InferenceServer
    from webapp.runs.jobs import job_release, job_secret_issue
    from webapp.runs.models import Run, RunEvent
    from webapp.runs.services import run_transition
    from workers.ray_cluster import submit_job

    run = run_transition(
        run=run, to=Run.Status.STARTING, message="A worker is submitting the run to Ray."
    )
    InferenceServer.objects.filter(
        run=run
    ).delete()  # servers of a previous attempt are gone with it
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


@shared_task(name="runs.launch", bind=True, max_retries=3, default_retry_delay=5)
def run_launch(self, run_id: str) -> str:
    from webapp.runs.models import Run
    from webapp.runs.services import IllegalTransition, run_transition

    run = Run.objects.filter(pk=run_id).first()
    if run is None or run.status != Run.Status.QUEUED:
        return "skipped"
    try:
        return launch(run)
    except IllegalTransition as exc:
        logger.info("launch of %s skipped: %s", run_id, exc)
        return "skipped"
    except Exception as exc:
        logger.exception("launch of %s failed", run_id)
        run.refresh_from_db()
        if run.status in (Run.Status.QUEUED, Run.Status.STARTING):
            run_transition(
                run=run,
                to=Run.Status.FAILED,
                error=f"Could not launch the run: {type(exc).__name__}: {exc}",
            )
        return "failed"


@shared_task(name="runs.shutdown", bind=True)
def run_shutdown(self, run_id: str, grace_s: float = 120.0) -> str:
    """Finish a stop request: the job checkpoints and reports ``stopped``; after ``grace_s`` it is stopped by force."""
    from webapp.runs.models import Run
    from webapp.runs.services import IllegalTransition, run_transition
    from workers.ray_cluster import job_status, stop_job

    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return "missing"
    deadline = time.monotonic() + grace_s
    while run.job_id and time.monotonic() < deadline:
        run.refresh_from_db()
        if run.status != Run.Status.STOPPING:
            return run.status
        if job_status(_cluster(), run.job_id) in ("STOPPED", "SUCCEEDED", "FAILED", "MISSING"):
            break
        time.sleep(1.0)
    run.refresh_from_db()
    if run.status != Run.Status.STOPPING:
        return run.status
    if run.job_id:
        stop_job(_cluster(), run.job_id)
    try:
        run_transition(run=run, to=Run.Status.STOPPED, message="Stopped by the worker.")
    except IllegalTransition:
        pass
    return "stopped"


@shared_task(name="runs.reconcile")
def runs_reconcile() -> dict:
    """Find runs whose Ray job died (worker restart, reboot, crash): mark them and restart from the last checkpoint."""
    from django.conf import settings

    from webapp.runs.jobs import job_release
    from webapp.runs.models import Run, RunEvent
    from webapp.runs.services import IllegalTransition, run_transition
    from workers.ray_cluster import RayUnavailable, job_logs_tail, job_status

    summary = {"restarted": 0, "failed": 0}
    active = Run.objects.filter(status__in=[Run.Status.STARTING, Run.Status.RUNNING]).exclude(
        job_id=""
    )
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
        if run.status not in (Run.Status.STARTING, Run.Status.RUNNING):
            continue
        tail = job_logs_tail(cluster, run.job_id)
        Run.objects.filter(pk=run.pk).update(job_log_tail=tail)
        released = job_release(run=run)
        try:
            run = run_transition(
                run=run,
                to=Run.Status.FAILED,
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
            run = run_transition(
                run=run, to=Run.Status.QUEUED, message="Restarted by the reconciler."
            )
            run_launch.delay(str(run.id))
            summary["restarted"] += 1
        else:
            summary["failed"] += 1
    return summary


@shared_task(name="sessions.expire_idle")
def sessions_expire_idle() -> int:
    """Close agent sessions idle past SESSION_IDLE_TIMEOUT_S (kept as expired, not trained unless configured)."""
    from webapp.gateway.admission import refresh_active_runs
    from webapp.gateway.services import sessions_expire_idle as expire

    expired = expire()
    refresh_active_runs()  # slots of sessions deleted with their agent come back
    return expired
