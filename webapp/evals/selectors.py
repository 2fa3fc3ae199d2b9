from __future__ import annotations

from django.db.models import QuerySet
from django.http import Http404

from webapp.accounts.selectors import parse_uuid
from webapp.evals.models import Eval, EvalExample
from webapp.runs.models import Run


def eval_list(*, run: Run) -> QuerySet[Eval]:
    return (
        Eval.objects.filter(project_id=run.project_id, run=run)
        .select_related("dataset", "checkpoint")
        .order_by("-created_at")
    )


def eval_get(*, run: Run, eval_id) -> Eval:
    """One of the run's evals; another run's (or project's) answers 404."""
    evaluation = eval_list(run=run).filter(pk=parse_uuid(eval_id)).first()
    if evaluation is None:
        raise Http404("Eval not found.")
    return evaluation


def eval_examples(*, evaluation: Eval, order: str = "index") -> QuerySet[EvalExample]:
    """``order``: index, or worst / best (by the example's mean reward)."""
    examples = EvalExample.objects.filter(eval=evaluation)
    by = {"worst": ["mean_reward", "index"], "best": ["-mean_reward", "index"]}
    return examples.order_by(*by.get(order, ["index"]))


def eval_series(*, run: Run) -> list[Eval]:
    """The run's finished held-out evals, by step: the eval score beside the training reward."""
    return list(
        Eval.objects.filter(run=run, status=Eval.Status.DONE, split=Eval.Split.HELD_OUT)
        .select_related("checkpoint")
        .order_by("step", "created_at")
    )
