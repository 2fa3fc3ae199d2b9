"""What a run's Ray job reports through the internal API: status, servers, metrics,
checkpoints, trajectories. The job never touches the database itself."""

from __future__ import annotations

import math
import uuid

from django.db import connection, transaction
from django.utils import timezone

from webapp.accounts.keys import generate_key, hash_key
from webapp.evals.services import eval_schedule_for_checkpoint
from webapp.gateway import lifecycle
from webapp.gateway.models import Interaction, Session
from webapp.gateway.selectors import session_trajectories
from webapp.gateway.services import (
    inference_server_register,
    inference_server_unregister,
    trajectories_claim,
)
from webapp.rewards.services import reward_losses_take
from webapp.runs.events import metrics_event, publish_run_event, status_event
from webapp.runs.models import Checkpoint, ClusterReport, MetricPoint, Run, RunEvent
from webapp.runs.services import IllegalTransition, run_transition

S = Run.Status
JOB_SECRET_PREFIX = "steep-job-"


def job_secret_issue(*, run: Run) -> str:
    """A fresh secret for a new attempt of the run's job; the previous attempt's stops working."""
    secret = generate_key(JOB_SECRET_PREFIX)
    Run.objects.filter(pk=run.pk).update(
        job_secret_hash=hash_key(secret), job_attempt=run.job_attempt + 1
    )
    run.refresh_from_db(fields=["job_secret_hash", "job_attempt"])
    return secret


def job_authenticate(*, run_id, token: str | None) -> Run | None:
    if not token or not token.startswith(JOB_SECRET_PREFIX):
        return None
    try:
        run_uuid = uuid.UUID(str(run_id))
    except ValueError:
        return None
    return (
        Run.objects.filter(pk=run_uuid, job_secret_hash=hash_key(token))
        .exclude(job_secret_hash="")
        .first()
    )


def job_report_status(*, run: Run, status: str, message: str = "", error: str | None = None) -> Run:
    """Move the run as its job says; repeating the current status is a no-op, and so is any
    report on an interrupted run (its job is going down with Steep: what it says last is moot)."""
    run.refresh_from_db()
    if run.status in (status, S.INTERRUPTED):
        return run
    if status == S.COMPLETED and run.status == S.STARTING:
        run = run_transition(run=run, to=S.RUNNING, message="Job reported completion.")
    if status == S.STOPPED and run.status in (S.STARTING, S.RUNNING):
        # Stopped from outside Steep (e.g. Ray's dashboard): record it as a stop.
        run = run_transition(run=run, to=S.STOPPING, message="The job was stopped outside Steep.")
    with transaction.atomic():
        run = run_transition(run=run, to=status, message=message, error=error)
        if status != S.RUNNING:
            # What the job claimed but never trained (e.g. the buffered second trajectory of a
            # session whose first one made the last step) is ready again, not claimed forever.
            job_release(run=run)
    return run


def job_run_status(*, run: Run) -> str:
    """The run's status now (the job watches it for a stop request)."""
    return Run.objects.filter(pk=run.pk).values_list("status", flat=True).get()


def job_register_server(*, run: Run, url: str, backend: str) -> None:
    inference_server_register(run=run, url=url, backend=backend)
    RunEvent.objects.create(
        run=run, kind="server", message=f"{backend} inference server up at {url}."
    )
    run.refresh_from_db()
    if run.status == S.STARTING:
        run_transition(run=run, to=S.RUNNING, message="First inference server is healthy.")


def job_unregister_server(*, run: Run, url: str) -> None:
    inference_server_unregister(run=run, url=url)


def job_report_metrics(*, run: Run, step: int, version: int, metrics: dict[str, float]) -> int:
    """Store one step's metrics (idempotent per name and step) and push them to the dashboard."""
    points = [
        MetricPoint(run=run, step=step, name=str(name)[:100], value=float(value))
        for name, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ]
    with transaction.atomic():
        MetricPoint.objects.bulk_create(
            points,
            update_conflicts=True,
            unique_fields=["run", "name", "step"],
            update_fields=["value"],
        )
        locked = Run.objects.select_for_update().get(pk=run.pk)
        locked.step = max(locked.step, step)
        locked.weight_version = max(locked.weight_version, version)
        locked.save(update_fields=["step", "weight_version", "updated_at"])
    transaction.on_commit(
        lambda: publish_run_event(
            run.id, metrics_event(run, points) | {"step": step, "weight_version": version}
        )
    )
    return len(points)


def job_report_cluster(*, run: Run, gpus: float, cpus: float) -> None:
    """The cluster's totals as ``run``'s job saw them; new runs are checked against them."""
    ClusterReport.objects.update_or_create(
        pk=1, defaults={"gpus": gpus, "cpus": cpus, "reported_at": timezone.now()}
    )


def job_report_version(*, run: Run, version: int) -> None:
    """New weights are live in the inference servers: the gateway's staleness budget grows."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if version > locked.weight_version:
            locked.weight_version = version
            locked.save(update_fields=["weight_version", "updated_at"])
    run.refresh_from_db()
    publish_run_event(run.id, status_event(run))


def job_report_checkpoint(
    *, run: Run, version: int, step: int, path: str, size_bytes: int
) -> Checkpoint:
    checkpoint, _ = Checkpoint.objects.update_or_create(
        run=run, version=version, defaults={"step": step, "path": path, "size_bytes": size_bytes}
    )
    RunEvent.objects.create(
        run=run, kind="checkpoint", message=f"Saved version {version} at step {step}."
    )
    # eval_every: queued for a worker; the job goes on training meanwhile.
    eval_schedule_for_checkpoint(checkpoint=checkpoint)
    return checkpoint


def job_claim_trajectories(*, run: Run, limit: int, token: str = "") -> list[dict]:
    out = []
    for session in trajectories_claim(run=run, limit=limit, token=token):
        trajectories = session_trajectories(session)
        out.append(
            {"session_id": str(session.id), "trajectories": [t.to_dict() for t in trajectories]}
        )
    return out


def job_hint_signals(*, run: Run, sessions: dict[str, dict]) -> int:
    """Keep what each session's hint did (``Session.hint_signal``) for its page; the run's
    sessions only."""
    updated = 0
    for session_id, value in sessions.items():
        signal = {"hint": str(value.get("hint") or ""), "trajectories": value["trajectories"]}
        updated += Session.objects.filter(run=run, pk=session_id).update(hint_signal=signal)
    return updated


def job_take_unrewarded(*, run: Run) -> int:
    """How many of the run's sessions became unscored or dropped since the job last asked."""
    return reward_losses_take(run=run)


def job_mark_trained(*, run: Run, version: int, trained: list[str], dropped: list[str]) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        lifecycle.finish_training(
            cursor, run_id=run.pk, version=version, trained=trained, dropped=dropped
        )


def job_release(*, run: Run, session_ids: list[str] | None = None) -> int:
    """Claimed but untrained sessions go back to ready (all of them when no ids: a restarted job)."""
    with transaction.atomic(), connection.cursor() as cursor:
        return lifecycle.release(cursor, run_id=run.pk, session_ids=session_ids)


def job_resume(*, run: Run, step: int, version: int) -> dict:
    """The job restored the checkpoint of ``step`` / ``version`` (0 / 0: none, from the start),
    before serving anything: the run goes back to that point of its lineage, in one transaction.

    Claims of the previous attempt are released; sessions trained after ``version`` are ready
    again (``lifecycle.rewind``: that training is lost with the process that did it); metric
    points after ``step`` and checkpoints after ``version`` are dropped, so the chart has no
    duplicate steps; the run's step and version become the checkpoint's, which the servers
    serve from now on. Returns what the job's admission and rollout driver resume from
    (``dropped``: trajectories dropped as stale, in any lineage: drops are never rewound).
    """
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        with connection.cursor() as cursor:
            released = lifecycle.release(cursor, run_id=run.pk)
            rewound = lifecycle.rewind(cursor, run_id=run.pk, version=version)
        MetricPoint.objects.filter(run=run, step__gt=step).delete()
        Checkpoint.objects.filter(run=run, version__gt=version).delete()
        previous = locked.weight_version
        locked.step, locked.weight_version = step, version
        locked.save(update_fields=["step", "weight_version", "updated_at"])
        origin = (
            f"checkpoint of step {step} (version {version})"
            if step
            else "version 0: no checkpoint was saved"
        )
        message = f"Restarted from {origin}."
        if previous != version:
            message += f" The run was at version {previous}."
        if rewound:
            message += f" {rewound} trajectories trained after it will be trained again."
        if step or previous or rewound or released:
            RunEvent.objects.create(run=run, kind=RunEvent.RESUME, message=message)
        else:  # a first start: nothing to go back from
            message = "Training starts from version 0."
        counters = Run.objects.filter(pk=run.pk).values("sessions_accepted").get()
        dropped = Session.objects.filter(
            run=run, trajectory=Session.Trajectory.DROPPED, drop_reason=lifecycle.DROP_STALE
        ).count()
        rows_used = dataset_rows_used(run=run) if run.mode == Run.Mode.DATASET else {}
    run.refresh_from_db()
    transaction.on_commit(lambda: publish_run_event(run.id, status_event(run)))
    return {
        "released": released,
        "rewound": rewound,
        "accepted": counters["sessions_accepted"],
        "dropped": dropped,
        "rows_used": rows_used,
        "message": message,
    }


def dataset_rows_used(*, run: Run) -> dict[int, int]:
    """How many groups of each dataset row the run has submitted (``metadata.row_index``)."""
    groups: dict[int, set[str]] = {}
    sessions = Session.objects.filter(run=run, agent__isnull=True).values_list(
        "metadata", flat=True
    )
    for metadata in sessions.iterator():
        index = (metadata or {}).get("row_index")
        if isinstance(index, int):
            groups.setdefault(index, set()).add(str(metadata.get("group_id", "")))
    return {index: len(ids) for index, ids in sorted(groups.items())}


def job_submit_episodes(*, run: Run, episodes: list[dict]) -> list[str]:
    """Record dataset-mode episodes exactly as gateway sessions: ended, rewarded, ready to train.

    Each episode: ``input_ids``, ``output_ids``, ``logprobs``, ``versions``, ``reward``,
    ``finish_reason``, ``messages``, ``text``, optional ``group_id``, ``task_id``, ``metadata``.
    A ``reward`` of None (a judge or human run) records the episode unrewarded: the worker's
    ``rewards.judge`` task (``webapp.rewards``) scores it, or a person does.

    Idempotent for episodes with a ``group_id``: a session's id is derived from the run, the
    group and the episode's place in it, so the job's retry of a submission whose answer was
    lost (the web process restarted after the commit) records nothing twice.
    """
    now = timezone.now()
    sessions, interactions = [], []
    ids = [_episode_session_id(run, episode, index) for index, episode in enumerate(episodes)]
    recorded = set(Session.objects.filter(pk__in=ids).values_list("pk", flat=True))
    for session_id, episode in zip(ids, episodes, strict=True):
        if session_id in recorded:
            continue
        sessions.append(
            {
                "id": session_id,
                "project": run.project_id,
                "agent": None,
                "run": run.pk,
                "key_hash": None,
                "one_turn": True,
                "task_id": str(episode.get("task_id", ""))[:200],
                "metadata": {
                    "group_id": episode.get("group_id", ""),
                    **(episode.get("metadata") or {}),
                },
                "admitted_version": min(episode["versions"], default=0),
                "interaction_count": 1,
                "server_url": "",
                "created_at": now,
                "last_activity_at": now,
                "ended_at": now,
            }
        )
        output = {
            "output_ids": episode["output_ids"],
            "logprobs": episode["logprobs"],
            "versions": episode["versions"],
            "finish_reason": episode.get("finish_reason", "stop"),
            "text": episode.get("text", ""),
        }
        response = {
            "id": f"rollout-{session_id.hex}",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": episode.get("text", "")},
                    "finish_reason": output["finish_reason"],
                }
            ],
        }
        interactions.append(
            Interaction(
                id=response["id"],
                session_id=session_id,
                turn=0,
                request_hash="",
                messages=episode.get("messages") or [],
                sampling=episode.get("sampling") or {},
                **Interaction.sampling_columns(episode.get("sampling")),
                input_ids=episode["input_ids"],
                outputs=[output],
                response=response,
                reward=None if episode.get("reward") is None else float(episode["reward"]),
                rewarded_at=None if episode.get("reward") is None else now,
                latency_ms=float(episode.get("latency_ms", 0.0)),
                created_at=now,
            )
        )
    scored = [
        row for row, turn in zip(sessions, interactions, strict=True) if turn.reward is not None
    ]
    unscored = [row for row in sessions if row not in scored]
    with transaction.atomic():
        with connection.cursor() as cursor:
            lifecycle.insert_finished(cursor, run_id=run.pk, rows=scored)
            if unscored:
                lifecycle.insert_finished(cursor, run_id=run.pk, rows=unscored, rewarded=False)
        Interaction.objects.bulk_create(interactions)
    return [str(session_id) for session_id in ids]


def _episode_session_id(run: Run, episode: dict, index: int) -> uuid.UUID:
    group = str(episode.get("group_id") or "")
    return uuid.uuid5(run.pk, f"{group}/{index}") if group else uuid.uuid4()


def job_event(*, run: Run, kind: str, message: str) -> None:
    RunEvent.objects.create(run=run, kind=kind[:40], message=message)


__all__ = [name for name in globals() if name.startswith("job_")] + ["IllegalTransition"]
