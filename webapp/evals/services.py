"""Evaluations of a run's models: requested by hand or every ``eval_every`` steps, run by a
worker (``webapp.evals.executing``). ``queued → running → done | failed``; only these
functions write an eval's status."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from rl_core.config import stored_setting
from rl_core.evals import example_scores, summarize
from webapp.datasets.models import Dataset
from webapp.evals.models import Eval, EvalExample
from webapp.runs.events import metrics_event, publish_run_event
from webapp.runs.models import Checkpoint, MetricPoint, Run, RunEvent

# The run's chart series (beside rollout/reward) that a held-out eval adds at its step.
EVAL_METRICS = ("eval/mean_reward", "eval/pass_at_k")


class EvalRefused(Exception):
    """The eval cannot be run as asked; the message says why and what to do."""


def eval_request(
    *,
    run: Run,
    checkpoints: Sequence[Checkpoint] = (),
    base: bool = False,
    dataset: Dataset | None = None,
    split: str | None = None,
    k: int | None = None,
    max_examples: int | None = None,
    scheduled: bool = False,
) -> list[Eval]:
    """Queue one eval per model (the base model first, then ``checkpoints``).

    Defaults come from the run's settings: its dataset, the held-out split when it holds
    rows out (``eval_fraction``), else all of the dataset's rows, ``eval_k``, its reward,
    ``max_new_tokens``, ``temperature`` and ``top_p``. Raises ``EvalRefused``.
    """
    config = run.config
    if not stored_setting(config, "reward"):
        raise EvalRefused(
            "The run has no reward to score answers with; evaluations use the run's reward "
            "setting (dataset mode)."
        )
    if not base and not checkpoints:
        raise EvalRefused("Name at least one model: base_model, or checkpoints.")
    dataset = dataset or run.dataset
    if dataset is None:
        raise EvalRefused("The run has no dataset; name one to evaluate on.")
    fraction = float(stored_setting(config, "eval_fraction"))
    if split is None:
        split = Eval.Split.HELD_OUT if fraction and dataset == run.dataset else Eval.Split.ALL
    if split == Eval.Split.HELD_OUT and not fraction:
        raise EvalRefused(
            "The run holds no rows out (eval_fraction is 0): evaluate on split 'all', or "
            "clone the run with eval_fraction set."
        )
    for checkpoint in checkpoints:
        if checkpoint.run_id != run.pk:
            raise EvalRefused(f"Checkpoint {checkpoint.pk} is not this run's.")
        if not Path(checkpoint.path).is_dir():
            raise EvalRefused(
                f"The files of the checkpoint at step {checkpoint.step} are gone "
                f"({checkpoint.path}); there is nothing to evaluate."
            )
    common = {
        "project_id": run.project_id,
        "run": run,
        "dataset": dataset,
        "split": split,
        "scheduled": scheduled,
        "k": k or int(stored_setting(config, "eval_k")),
        "max_examples": int(
            max_examples
            if max_examples is not None
            else (stored_setting(config, "eval_max_examples") if scheduled else 0)
        ),
        "pass_threshold": float(stored_setting(config, "eval_pass_threshold")),
        "max_new_tokens": int(stored_setting(config, "max_new_tokens")),
        "temperature": float(stored_setting(config, "temperature")),
        "top_p": float(stored_setting(config, "top_p")),
    }
    models: list[Checkpoint | None] = ([None] if base else []) + list(checkpoints)
    with transaction.atomic():
        evals = [
            Eval.objects.create(checkpoint=c, step=c.step if c else 0, **common) for c in models
        ]
        labels = ", ".join(e.model_label for e in evals)
        RunEvent.objects.create(
            run=run, kind="eval", message=f"Evaluation of {labels} on {dataset.name} ({split})."
        )
    ids = [str(e.pk) for e in evals]
    transaction.on_commit(lambda: _queue(ids))
    return evals


def _queue(ids: list[str]) -> None:
    from webapp.evals.tasks import eval_execute

    for eval_id in ids:
        eval_execute.delay(eval_id)


def eval_schedule_for_checkpoint(*, checkpoint: Checkpoint) -> Eval | None:
    """The eval ``eval_every`` asks for at this checkpoint's step, queued; None when none is
    due. The training job is never waited for: the eval runs in a worker."""
    run = checkpoint.run
    every = int(stored_setting(run.config, "eval_every"))
    if not every or checkpoint.step == 0 or checkpoint.step % every:
        return None
    if Eval.objects.filter(checkpoint=checkpoint, scheduled=True).exists():
        return None  # the same checkpoint reported again
    try:
        (evaluation,) = eval_request(run=run, checkpoints=[checkpoint], scheduled=True)
    except EvalRefused as exc:
        RunEvent.objects.create(run=run, kind="eval", message=f"Scheduled eval skipped: {exc}")
        return None
    return evaluation


def eval_start(*, evaluation: Eval, total: int) -> bool:
    """queued → running; False when it was not queued (a duplicate delivery)."""
    now = timezone.now()
    updated = Eval.objects.filter(pk=evaluation.pk, status=Eval.Status.QUEUED).update(
        status=Eval.Status.RUNNING,
        started_at=now,
        heartbeat_at=now,
        attempts=F("attempts") + 1,
        progress_total=total,
        progress_done=0,
    )
    return bool(updated)


def eval_heartbeat(*, evaluation: Eval) -> None:
    """The worker running ``evaluation`` is alive (every ``EVAL_HEARTBEAT_S``)."""
    Eval.objects.filter(pk=evaluation.pk, status=Eval.Status.RUNNING).update(
        heartbeat_at=timezone.now()
    )


def eval_reconcile() -> dict[str, int]:
    """Evals left running by a worker that was killed (no heartbeat for 4 intervals) go back
    to the queue, or fail once they have been started ``EVAL_MAX_ATTEMPTS`` times."""
    silent_since = timezone.now() - timedelta(seconds=4 * settings.EVAL_HEARTBEAT_S)
    requeued, failed = [], 0
    with transaction.atomic():
        stopped = Eval.objects.select_for_update(skip_locked=True).filter(
            status=Eval.Status.RUNNING, heartbeat_at__lt=silent_since
        )
        for evaluation in stopped:
            gone = "The worker running it stopped"
            if evaluation.attempts >= settings.EVAL_MAX_ATTEMPTS:
                error = f"{gone} {evaluation.attempts} times; not retried."
                eval_fail(evaluation=evaluation, error=error)
                failed += 1
                continue
            Eval.objects.filter(pk=evaluation.pk).update(
                status=Eval.Status.QUEUED, heartbeat_at=None, progress_done=0
            )
            RunEvent.objects.create(
                run_id=evaluation.run_id,
                kind="eval",
                message=f"Eval of {evaluation.model_label}: {gone.lower()}; queued again"
                f" (start {evaluation.attempts + 1} of {settings.EVAL_MAX_ATTEMPTS}).",
            )
            requeued.append(str(evaluation.pk))
    if requeued:
        transaction.on_commit(lambda: _queue(requeued))
    return {"requeued": len(requeued), "failed": failed}


def eval_progress(*, evaluation: Eval, done: int) -> None:
    Eval.objects.filter(pk=evaluation.pk, status=Eval.Status.RUNNING).update(progress_done=done)


def eval_fail(*, evaluation: Eval, error: str) -> None:
    Eval.objects.filter(pk=evaluation.pk).exclude(status=Eval.Status.DONE).update(
        status=Eval.Status.FAILED, error=error, finished_at=timezone.now()
    )
    RunEvent.objects.create(
        run_id=evaluation.run_id, kind="eval", message=f"Eval of {evaluation.model_label} failed."
    )


def eval_finish(*, evaluation: Eval, results: list[dict]) -> Eval:
    """Store each example's results and the summary; a held-out eval also becomes points of
    the run's ``eval/*`` metrics at its step."""
    k, threshold = evaluation.k, evaluation.pass_threshold
    summary = summarize([r["rewards"] for r in results], k=k, threshold=threshold)
    rows = []
    for r in results:
        mean, passed = example_scores(r["rewards"], k, threshold)
        rows.append(
            EvalExample(
                eval=evaluation,
                index=r["index"],
                messages=r["messages"],
                answer=r.get("answer"),
                completions=r["completions"],
                rewards=r["rewards"],
                errors=r.get("errors") or [],
                mean_reward=mean,
                pass_at_k=passed,
            )
        )
    points = []
    with transaction.atomic():
        EvalExample.objects.filter(eval=evaluation).delete()
        EvalExample.objects.bulk_create(rows, batch_size=500)
        Eval.objects.filter(pk=evaluation.pk).update(
            status=Eval.Status.DONE,
            finished_at=timezone.now(),
            progress_done=len(results),
            examples=summary.examples,
            mean_reward=summary.mean_reward,
            mean_reward_low=summary.mean_reward_ci[0],
            mean_reward_high=summary.mean_reward_ci[1],
            pass_at_k=summary.pass_at_k,
            pass_at_k_low=summary.pass_at_k_ci[0],
            pass_at_k_high=summary.pass_at_k_ci[1],
        )
        if evaluation.split == Eval.Split.HELD_OUT:
            for name, value in zip(
                EVAL_METRICS, (summary.mean_reward, summary.pass_at_k), strict=True
            ):
                if math.isfinite(value):
                    point, _ = MetricPoint.objects.update_or_create(
                        run_id=evaluation.run_id,
                        name=name,
                        step=evaluation.step,
                        defaults={"value": value},
                    )
                    points.append(point)
        RunEvent.objects.create(
            run_id=evaluation.run_id,
            kind="eval",
            message=f"Eval of {evaluation.model_label}: mean reward {summary.mean_reward:.3f}, "
            f"pass@{k} {summary.pass_at_k:.3f} over {summary.examples} examples.",
        )
    run = evaluation.run
    if points:
        transaction.on_commit(lambda: publish_run_event(run.id, metrics_event(run, points)))
    evaluation.refresh_from_db()
    return evaluation


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
