"""A run's Ray job: submitting it, stopping it, and noticing when it died.

What the Celery tasks in ``webapp.runs.tasks`` call. The Ray side (the cluster, the Jobs
API) is ``workers.ray_cluster``; every status change goes through ``run_transition``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from rl_core.sources import errors_text
from webapp.gateway.models import InferenceServer
from webapp.runs.jobs import job_release, job_secret_issue
from webapp.runs.models import ClusterReport, Run, RunEvent
from webapp.runs.queueing import run_wait_reason
from webapp.runs.services import IllegalTransition, run_queue, run_transition, run_wait
from webapp.runs.sources import run_sourced
from workers.ray_cluster import (
    RayCluster,
    RayUnavailable,
    ensure_cluster,
    inference_pid_dir,
    job_logs_tail,
    job_status,
    stop_job,
    submit_job,
)

logger = logging.getLogger(__name__)

S = Run.Status
JOB_ENDED = ("STOPPED", "SUCCEEDED", "FAILED", "MISSING")
# A launch takes minutes at most (a new local head, its job agent): a run starting for
# longer without a job lost its launch.
LAUNCH_TIMEOUT = timedelta(minutes=10)


def steep_cluster() -> RayCluster:
    """The cluster Steep submits jobs to: RAY_ADDRESS, or the local head (started if needed)."""
    return ensure_cluster(
        data_dir=settings.DATA_DIR,
        address=settings.RAY_ADDRESS,
        num_cpus=settings.RAY_NUM_CPUS or None,
        dashboard_port=settings.RAY_LOCAL_DASHBOARD_PORT,
        gcs_port=settings.RAY_LOCAL_GCS_PORT,
    )


def _start_or_wait(run: Run) -> str:
    """Move the queued ``run`` to starting, or keep it queued with the reason, which is returned,
    when the cluster has no room for it now (``webapp.runs.queueing``).

    One launch decides at a time (the cluster report's row lock; on SQLite every transaction
    is IMMEDIATE), so two workers' launches cannot both count the last free GPU as theirs.
    """
    with transaction.atomic():
        list(ClusterReport.objects.select_for_update())
        if reason := run_wait_reason(run=run):
            run_wait(run=run, reason=reason)
            return reason
        # The previous attempt's job id goes first: until the new job is submitted, the
        # reconciler would find that one gone and take the starting run for a crashed one.
        Run.objects.filter(pk=run.pk).update(job_id="")
        run_transition(run=run, to=S.STARTING, message="A worker is submitting the run to Ray.")
    return ""


def _submit(run: Run) -> str:
    run.refresh_from_db()
    InferenceServer.objects.filter(run=run).delete()  # servers of a previous attempt are gone
    job_release(run=run)
    secret = job_secret_issue(run=run)
    job_id = f"steep-run-{run.id.hex[:12]}-a{run.job_attempt}-{int(time.time())}"
    cluster = steep_cluster()
    env = {
        "STEEP_JOB_SECRET": secret,
        "PYTHONUNBUFFERED": "1",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "STEEP_TORCH_THREADS": str(settings.STEEP_TORCH_THREADS),
        "STEEP_PLACEMENT_TIMEOUT_S": str(settings.STEEP_PLACEMENT_TIMEOUT_S),
        "STEEP_WEIGHT_SYNC_TIMEOUT_S": str(settings.STEEP_WEIGHT_SYNC_TIMEOUT_S),
    }
    if settings.STEEP_HUB_MODELS and "HF_HUB_CACHE" not in os.environ:
        # Hugging Face ids are downloaded into the models directory, not a user's home.
        env["HF_HUB_CACHE"] = str(settings.DATA_DIR / "models" / "hub")
    # Traces (docs/metrics.md): the job exports where this process would; it is its own service.
    env |= {
        k: v for k, v in os.environ.items() if k.startswith("OTEL_") and k != "OTEL_SERVICE_NAME"
    }
    if settings.STEEP_FAILPOINTS:  # chaos tests (rl_core.failpoints)
        env["STEEP_FAILPOINTS"] = settings.STEEP_FAILPOINTS
    if cluster.local:  # this machine: record the inference servers where a stop of Steep finds them
        env["STEEP_PID_DIR"] = str(inference_pid_dir(settings.DATA_DIR))
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
        cluster,
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

    A run the cluster has no room for now stays ``queued`` with the reason
    (``webapp.runs.queueing``) and ``"queued"`` is returned: ``runs_reconcile`` tries again.
    Otherwise returns the job id, ``"skipped"`` when the run is gone or no longer queued, or
    ``"failed"`` when the submission failed: the run is then ``failed`` with the reason
    (``"interrupted"`` when it failed because Steep was being stopped: ``runs_interrupt``).
    """
    run = Run.objects.filter(pk=run_id).first()
    if run is None or run.status != S.QUEUED:
        return "skipped"
    _, refused = run_sourced(run=run)
    if refused:  # the instance's rules, checked again: a config written before them, or by hand
        try:
            run_transition(run=run, to=S.FAILED, error=errors_text(refused))
        except IllegalTransition:
            return "skipped"
        return "failed"
    try:
        if _start_or_wait(run):
            return "queued"
        return _submit(run)
    except IllegalTransition as exc:  # stopped or launched by someone else meanwhile
        logger.info("launch of %s skipped: %s", run_id, exc)
        return "skipped"
    except Exception as exc:  # whatever broke (Ray unreachable, a refused job), the run says why
        run.refresh_from_db()
        if run.status == S.INTERRUPTED:  # Steep is stopping, and Ray with it: not a failure
            logger.info("launch of %s interrupted: %s", run_id, exc)
            return "interrupted"
        logger.exception("launch of %s failed", run_id)
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
        try:
            if job_status(steep_cluster(), run.job_id) in JOB_ENDED:
                break
        except RayUnavailable:  # Ray restarting, or going down with Steep: ask again
            pass
        time.sleep(1.0)
    run.refresh_from_db()
    if run.status != S.STOPPING:
        return run.status
    if run.job_id:
        stop_job(steep_cluster(), run.job_id)
    try:
        run_transition(run=run, to=S.STOPPED, message="Stopped by the worker.")
    except IllegalTransition:
        pass
    return "stopped"


def runs_reconcile() -> dict:
    """Find runs whose Ray job died (worker restart, reboot, crash) and hand each to
    ``run_job_died``, and launch queued runs that waited for the cluster, oldest first, when
    it has room for them. (A clean stop of Steep makes its runs ``interrupted`` first, so they
    are not seen here: see ``runs_interrupt``.)"""
    summary = {"restarted": 0, "failed": 0, "launched": 0}
    waiting = Run.objects.filter(status=S.QUEUED).exclude(queue_reason="").order_by("queued_at")
    for run in waiting:
        if run_launch(run_id=str(run.id)) not in ("queued", "skipped"):
            summary["launched"] += 1
    # A launch that never got its job submitted (its worker was killed meanwhile).
    lost = Run.objects.filter(
        status=S.STARTING, job_id="", updated_at__lt=timezone.now() - LAUNCH_TIMEOUT
    )
    for run in lost:
        outcome = run_job_died(run=run, state="NEVER SUBMITTED")
        if outcome in summary:
            summary[outcome] += 1
    active = Run.objects.filter(status__in=[S.STARTING, S.RUNNING]).exclude(job_id="")
    if not active.exists():
        return summary
    try:
        cluster = steep_cluster()
    except RayUnavailable as exc:
        logger.warning("reconcile: Ray unavailable: %s", exc)
        return summary
    for run in active:
        try:
            state = job_status(cluster, run.job_id)
        except RayUnavailable as exc:  # no telling whether its job died: ask next time
            logger.warning("reconcile: %s", exc)
            return summary
        if state in ("PENDING", "RUNNING"):
            continue
        outcome = run_job_died(
            run=run, state=state, log_tail=lambda run=run: job_logs_tail(cluster, run.job_id)
        )
        if outcome in summary:
            summary[outcome] += 1
    return summary


def run_job_died(*, run: Run, state: str, log_tail: Callable[[], str] = str) -> str:
    """The run's job ended (Ray says ``state``) while the run was starting or running: a crash.

    The run fails with the job's ``log_tail()`` and, while fewer than ``RUN_MAX_RESTARTS``
    restarts were made since it was last started by hand, is queued again from its last
    checkpoint. Returns ``"restarted"``, ``"failed"`` or ``"skipped"`` (the run moved meanwhile).
    """
    # Only the attempt Ray was asked about: a reconciler that read the run before another one
    # restarted it must not fail the new attempt (its restart would use up the budget at once).
    job_id = run.job_id
    run.refresh_from_db()
    if run.status not in (S.STARTING, S.RUNNING) or run.job_id != job_id:
        return "skipped"
    tail = log_tail()
    try:
        run = run_transition(
            run=run,
            to=S.FAILED,
            error=f"The run's Ray job ended unexpectedly ({state}).\n\n{tail}",
            only_from=(S.STARTING, S.RUNNING),
            job_id=job_id,
        )
    except IllegalTransition:
        return "skipped"
    Run.objects.filter(pk=run.pk).update(job_log_tail=tail)
    released = job_release(run=run)
    if run.crash_restarts >= settings.RUN_MAX_RESTARTS:
        return "failed"
    restarts = run.crash_restarts + 1
    Run.objects.filter(pk=run.pk).update(crash_restarts=restarts)
    RunEvent.objects.create(
        run=run,
        kind="reconcile",
        message=f"Job {state}; released {released} trajectories; restarting from the last "
        f"checkpoint (restart {restarts} of {settings.RUN_MAX_RESTARTS}).",
    )
    run_queue(run=run, message="Restarted by the reconciler.")
    return "restarted"


INTERRUPT_MESSAGES = {
    S.INTERRUPTED: "Steep was stopped; the run resumes from its last checkpoint when Steep starts.",
    S.STOPPED: "Steep was stopped while the run was stopping.",
}


def runs_interrupt(*, stop_jobs: bool = False) -> list[str]:
    """Steep is being stopped cleanly: every active run becomes ``interrupted`` (a stopping one
    ``stopped``), before its job goes down with Steep, so that neither the reconciler nor the
    job's own last reports turn the stop into a failure. Claimed trajectories go back to ready
    and the runs' inference servers are forgotten. With ``stop_jobs``, the runs' Ray jobs are
    asked to stop: for an external ``RAY_ADDRESS`` cluster, which outlives Steep (a local head
    is stopped whole, see ``workers.ray_cluster.stop_local_cluster``).

    Returns the ids of the interrupted runs.
    """
    interrupted, jobs = [], []
    for run in Run.objects.filter(status__in=[S.QUEUED, S.STARTING, S.RUNNING, S.STOPPING]):
        target = S.STOPPED if run.status == S.STOPPING else S.INTERRUPTED
        try:
            run = run_transition(run=run, to=target, message=INTERRUPT_MESSAGES[target])
        except IllegalTransition:  # moved meanwhile (e.g. the job completed)
            continue
        InferenceServer.objects.filter(run=run).delete()
        job_release(run=run)
        if run.job_id:
            jobs.append(run.job_id)
        if target == S.INTERRUPTED:
            interrupted.append(str(run.id))
    if stop_jobs and jobs:
        try:
            cluster = steep_cluster()
        except RayUnavailable:
            return interrupted
        for job_id in jobs:
            stop_job(cluster, job_id)
    return interrupted


def runs_resume() -> list[str]:
    """Queue every ``interrupted`` run again (at worker start-up): it resumes from its last
    checkpoint, and this uses none of its ``RUN_MAX_RESTARTS``. Returns their ids."""
    resumed = []
    for run in Run.objects.filter(status=S.INTERRUPTED):
        try:
            run_queue(run=run, message="Steep started again: resuming from the last checkpoint.")
        except IllegalTransition:  # another worker resumed it first
            continue
        resumed.append(str(run.id))
    return resumed
