"""Runs: creation and the one state machine every status change goes through."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from datetime import timedelta
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from rl_core.config import ConfigError, RunConfig
from rl_core.sources import SourceRefused
from webapp.accounts.models import Project
from webapp.datasets.models import Dataset
from webapp.observability import log_status
from webapp.pools.selectors import pool_attach_errors, teacher_pool_errors
from webapp.rewards.secrets import seal_config
from webapp.runs.events import publish_run_event, status_event
from webapp.runs.models import Checkpoint, ClusterReport, Run, RunEvent
from webapp.runs.sources import checkpoint_reference, config_sourced, source_rules
from workers.capacity import CapacityError, check_capacity, resolve_backend

S = Run.Status

# Legal moves. stopped/failed/interrupted runs may be queued again (they resume from their
# last checkpoint). interrupted: Steep was stopped cleanly under an active run
# (webapp.runs.launching.runs_interrupt); it is queued again at the next start, and a stop
# request keeps it stopped instead.
TRANSITIONS: dict[str, set[str]] = {
    S.DRAFT: {S.QUEUED},
    S.QUEUED: {S.STARTING, S.STOPPING, S.STOPPED, S.FAILED, S.INTERRUPTED},
    S.STARTING: {S.RUNNING, S.STOPPING, S.FAILED, S.INTERRUPTED},
    S.RUNNING: {S.STOPPING, S.COMPLETED, S.FAILED, S.INTERRUPTED},
    S.STOPPING: {S.STOPPED, S.FAILED},
    S.STOPPED: {S.QUEUED},
    S.FAILED: {S.QUEUED},
    S.INTERRUPTED: {S.QUEUED, S.STOPPED},
    S.COMPLETED: set(),
}


class IllegalTransition(Exception):
    def __init__(self, run: Run, current: str, target: str):
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "nothing (final state)"
        super().__init__(
            f"Run '{run.name}' is {current}; it cannot become {target} (from {current} it can become: {allowed})."
        )
        self.current, self.target = current, target


# An export running for longer than this lost its worker: a new request may start it again.
EXPORT_TIMEOUT = timedelta(hours=2)


class ExportRefused(Exception):
    """A checkpoint's export cannot start now; the message says why and what to do."""


class RunInvalid(Exception):
    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))


def run_create(
    *,
    project: Project,
    name: str,
    config: RunConfig,
    dataset: Dataset | None = None,
    unrestricted: bool = False,
) -> Run:
    """Create a draft run from an already validated config.

    What the config makes the server read, import and call is checked against the instance's
    rules (``webapp.runs.sources``); ``unrestricted`` is an operator's explicit bypass (a
    management command's flag), remembered so that the launch does not refuse it either.
    """
    config, refused = config_sourced(
        project=project, config=config, rules=source_rules(unrestricted=unrestricted)
    )
    if refused:
        raise RunInvalid(refused)
    if config.mode == Run.Mode.DATASET and dataset is None:
        raise RunInvalid(
            {"dataset": ["Dataset mode needs a dataset: upload one and pass its id as 'dataset'."]}
        )
    if dataset is not None and dataset.project_id != project.id:
        raise RunInvalid({"dataset": ["Dataset not found."]})
    if errors := (
        _cluster_errors(config)
        | pool_attach_errors(config=config)
        | teacher_pool_errors(config=config)
    ):
        raise RunInvalid(errors)
    run = Run.objects.create(
        project=project,
        name=name,
        mode=config.mode,
        base_model=config.base_model,
        dataset=dataset,
        config=seal_config(config.to_dict()),  # a judge's api_key is stored encrypted
        sources_unrestricted=unrestricted,
    )
    RunEvent.objects.create(
        run=run,
        kind="created",
        message=f"Run created in {config.mode} mode on {config.base_model}.",
    )
    return run


def _cluster_errors(config: RunConfig) -> dict[str, list[str]]:
    """What the Ray cluster, as a run's job last reported it, cannot give ``config``
    (``workers.capacity``, the rule the job applies); nothing before any report."""
    report = ClusterReport.objects.first()
    if report is None:
        return {}
    resources = {"GPU": report.gpus, "CPU": report.cpus}
    when = f"(as a run last reported it, {report.reported_at:%Y-%m-%d %H:%M} UTC)"
    errors: dict[str, list[str]] = {}
    if config.precision == "bf16" and not report.gpus:
        errors["precision"] = [
            f"precision bf16 needs GPUs, and the Ray cluster has none {when}; use auto or fp32."
        ]
    try:
        backend = resolve_backend(config.inference_backend, resources)
    except CapacityError as exc:
        errors["inference_backend"] = [f"{exc} {when}"]
        return errors
    try:
        check_capacity(config, backend, resources)
    except CapacityError as exc:
        errors["train_workers"] = [f"{exc} {when}"]
    return errors


def run_clone(
    *,
    run: Run,
    name: str | None = None,
    checkpoint: Checkpoint | None = None,
    overrides: dict | None = None,
) -> Run:
    """A new draft run with ``run``'s dataset and settings ("Run again"), any status allowed.

    ``overrides`` are settings that replace the source's (validated together by RunConfig).
    With ``checkpoint`` (one of ``run``'s), the new run starts from its weights
    (``init_checkpoint``); otherwise it starts where ``run`` started. Raises ``RunInvalid``.
    """
    if checkpoint is not None and checkpoint.run_id != run.id:
        raise RunInvalid({"from_checkpoint": ["Checkpoint not found in this run."]})
    if checkpoint is not None and not Path(checkpoint.path).is_dir():
        raise RunInvalid(
            {
                "from_checkpoint": [
                    f"The files of the checkpoint at step {checkpoint.step} are gone ({checkpoint.path})."
                ]
            }
        )
    known = {spec.name for spec in RunConfig.field_specs()}
    # Settings stored before a field was removed are dropped; new fields take their defaults.
    values = {key: value for key, value in run.config.items() if key in known}
    if values.get("init_checkpoint"):
        # A config written before checkpoints were named by id holds a path: the source's
        # own project's checkpoint at that path, by its id (refused by run_create otherwise).
        with contextlib.suppress(SourceRefused):
            values["init_checkpoint"] = str(
                checkpoint_reference(
                    project=run.project, value=values["init_checkpoint"], legacy_paths=True
                ).pk
            )
    if checkpoint is not None:
        values["init_checkpoint"] = str(checkpoint.pk)
    values |= overrides or {}
    try:
        config = RunConfig.from_dict(values)
    except ConfigError as exc:
        raise RunInvalid(
            {f"config.{key}": messages for key, messages in exc.errors.items()}
        ) from None
    if name is None:
        suffix = f" (from step {checkpoint.step})" if checkpoint is not None else " (again)"
        name = run.name[: 200 - len(suffix)] + suffix
    clone = run_create(
        project=run.project,
        name=name,
        config=config,
        dataset=run.dataset,
        unrestricted=run.sources_unrestricted and not overrides,
    )
    source = (
        f"checkpoint step {checkpoint.step} of" if checkpoint is not None else "the settings of"
    )
    RunEvent.objects.create(
        run=clone, kind="cloned", message=f"Cloned from {source} run '{run.name}' ({run.id})."
    )
    return clone


def run_transition(
    *,
    run: Run,
    to: str,
    message: str = "",
    error: str | None = None,
    only_from: Collection[str] | None = None,
    job_id: str | None = None,
) -> Run:
    """Move ``run`` to status ``to`` or raise IllegalTransition. Locks the row, so concurrent
    moves serialise. ``only_from`` and ``job_id``: raise IllegalTransition too unless the locked
    row is still in one of these statuses and on this job (what the caller decided on)."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        moved = (only_from is not None and locked.status not in only_from) or (
            job_id is not None and locked.job_id != job_id
        )
        if moved or to not in TRANSITIONS[locked.status]:
            raise IllegalTransition(locked, locked.status, to)
        now = timezone.now()
        fields = ["status", "updated_at", "queue_reason"]
        locked.status, locked.queue_reason = to, ""
        if to == S.QUEUED:
            locked.queued_at, locked.finished_at, locked.error = now, None, ""
            fields += ["queued_at", "finished_at", "error"]
        elif to == S.RUNNING:
            locked.started_at = now
            fields.append("started_at")
        elif to in {S.STOPPED, S.COMPLETED, S.FAILED}:
            locked.finished_at = now
            fields.append("finished_at")
        if error is not None:
            locked.error = error
            fields.append("error")
        locked.save(update_fields=fields)
        RunEvent.objects.create(run=locked, kind=f"status:{to}", message=message or error or "")
        event = status_event(locked)
        transaction.on_commit(lambda: publish_run_event(locked.id, event))
        transaction.on_commit(lambda: log_status("run", locked.name, to, error or message))
    run.refresh_from_db()
    return run


def run_wait(*, run: Run, reason: str) -> Run:
    """Keep a queued run waiting for the cluster, saying why (``reason``); a no-op unless queued.

    The reason is stored and shown on the run's page and in its API; a changed reason is
    also a line in its history. ``webapp.runs.launching.runs_reconcile`` tries it again.
    """
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status == S.QUEUED and locked.queue_reason != reason:
            locked.queue_reason = reason
            locked.save(update_fields=["queue_reason", "updated_at"])
            RunEvent.objects.create(run=locked, kind="queued", message=reason)
            event = status_event(locked)
            transaction.on_commit(lambda: publish_run_event(locked.id, event))
    run.refresh_from_db()
    return run


def run_start(*, run: Run) -> Run:
    """Queue the run at a user's request; it gets a fresh budget of crash restarts."""
    run = run_queue(run=run, message="Start requested.")
    Run.objects.filter(pk=run.pk).update(crash_restarts=0)
    run.crash_restarts = 0
    return run


def run_queue(*, run: Run, message: str) -> Run:
    """Queue the run and hand it to a worker's launch task, once the transaction has committed."""
    from webapp.runs.tasks import run_launch  # the tasks call the services, so not at import time

    run = run_transition(run=run, to=S.QUEUED, message=message)
    run_id = str(run.id)
    transaction.on_commit(lambda: run_launch.delay(run_id))
    return run


def run_stop(*, run: Run) -> Run:
    """Ask the job to stop; a worker's shutdown task stops it by force if it does not in time.

    An interrupted run has no job: it just stays stopped instead of resuming at the next start.
    """
    from webapp.runs.tasks import run_shutdown

    if run.status == S.INTERRUPTED:
        return run_transition(run=run, to=S.STOPPED, message="Stop requested.")
    run = run_transition(run=run, to=S.STOPPING, message="Stop requested.")
    run_id = str(run.id)
    transaction.on_commit(lambda: run_shutdown.delay(run_id))
    return run


def run_delete(*, run: Run) -> None:
    if run.is_active:
        raise IllegalTransition(run, run.status, "deleted")
    run.delete()


def run_mark_running(*, run: Run, message: str = "") -> Run:
    """Walk a run to ``running`` along legal transitions (used when servers are attached by hand)."""
    path = {
        S.DRAFT: [S.QUEUED, S.STARTING, S.RUNNING],
        S.STOPPED: [S.QUEUED, S.STARTING, S.RUNNING],
        S.FAILED: [S.QUEUED, S.STARTING, S.RUNNING],
        S.INTERRUPTED: [S.QUEUED, S.STARTING, S.RUNNING],
        S.QUEUED: [S.STARTING, S.RUNNING],
        S.STARTING: [S.RUNNING],
        S.RUNNING: [],
    }.get(run.status)
    if path is None:
        raise IllegalTransition(run, run.status, S.RUNNING)
    for status in path:
        run = run_transition(run=run, to=status, message=message)
    return run


def checkpoint_export_request(*, checkpoint: Checkpoint) -> Checkpoint:
    """Export ``checkpoint`` as a standalone model folder, in a worker (``webapp.runs.exporting``).

    Idempotent: a finished export whose folder is still there is returned as it is; a
    failed one is tried again. Raises ``ExportRefused`` while an export is running, or when
    the checkpoint's files are gone.
    """
    from webapp.runs.tasks import checkpoint_export

    E = Checkpoint.ExportStatus
    now = timezone.now()
    with transaction.atomic():
        checkpoint = (
            Checkpoint.objects.select_for_update().select_related("run").get(pk=checkpoint.pk)
        )
        if checkpoint.export_status == E.DONE and Path(checkpoint.export_path).is_dir():
            return checkpoint
        started = checkpoint.export_started_at
        if checkpoint.export_status == E.RUNNING and started and started > now - EXPORT_TIMEOUT:
            raise ExportRefused(
                f"An export of the checkpoint at step {checkpoint.step} is still running "
                f"(started {started:%Y-%m-%d %H:%M:%S} UTC); wait until its export_status is done or failed."
            )
        if not Path(checkpoint.path).is_dir():
            raise ExportRefused(
                f"The files of the checkpoint at step {checkpoint.step} are gone ({checkpoint.path}); "
                "there is nothing to export."
            )
        checkpoint.export_status = E.RUNNING
        checkpoint.export_path = ""
        checkpoint.export_error = ""
        checkpoint.export_started_at = now
        checkpoint.export_finished_at = None
        checkpoint.save(
            update_fields=[
                "export_status",
                "export_path",
                "export_error",
                "export_started_at",
                "export_finished_at",
            ]
        )
        RunEvent.objects.create(
            run=checkpoint.run,
            kind="export",
            message=f"Export of the checkpoint at step {checkpoint.step} requested.",
        )
    checkpoint_id = checkpoint.pk
    transaction.on_commit(lambda: checkpoint_export.delay(checkpoint_id))
    return checkpoint


def checkpoint_export_finish(
    *, checkpoint: Checkpoint, path: str = "", error: str = ""
) -> Checkpoint:
    """Record the end of ``checkpoint``'s export: its folder, or why it failed."""
    E = Checkpoint.ExportStatus
    checkpoint.export_status = E.FAILED if error else E.DONE
    checkpoint.export_path = "" if error else path
    checkpoint.export_error = error
    checkpoint.export_finished_at = timezone.now()
    checkpoint.save(
        update_fields=["export_status", "export_path", "export_error", "export_finished_at"]
    )
    outcome = (
        f"failed: {error.splitlines()[-1] if error else ''}" if error else f"written to {path}"
    )
    RunEvent.objects.create(
        run=checkpoint.run,
        kind="export",
        message=f"Export of the checkpoint at step {checkpoint.step} {outcome}",
    )
    return checkpoint
