"""The evals app's Celery task: takes an id, calls one service."""

from __future__ import annotations

from celery import shared_task

from webapp.evals import executing, services


@shared_task(name="evals.execute")
def eval_execute(eval_id: str) -> str:
    return executing.eval_execute(eval_id=eval_id)


@shared_task(name="evals.reconcile")
def eval_reconcile() -> dict[str, int]:
    return services.eval_reconcile()
