"""Dashboard pages for a run's evaluations: the run page's section (polled while one runs),
the "Evaluate" form, and an eval's page with its per-example results."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from webapp.accounts.selectors import project_get_for_user
from webapp.evals.models import Eval
from webapp.evals.selectors import eval_examples, eval_get, eval_list
from webapp.evals.services import EvalRefused, eval_request
from webapp.runs.models import Checkpoint
from webapp.runs.selectors import checkpoint_list, run_get

EXAMPLES_PER_PAGE = 25
ORDERS = {"index": "Row order", "worst": "Worst first", "best": "Best first"}


def evals_context(*, run) -> dict:
    """What the run page's Evaluations section shows (``_run_evals.html``)."""
    evals = list(eval_list(run=run)[:20])
    return {
        "evals": evals,
        "evals_active": any(e.status in (Eval.Status.QUEUED, Eval.Status.RUNNING) for e in evals),
        "eval_checkpoints": checkpoint_list(run=run)[:50],
    }


@login_required
def run_evals(request, project_id, run_id):
    """The Evaluations section alone (htmx polls it while an eval runs), or the run page."""
    project = project_get_for_user(user=request.user, project_id=project_id)
    run = run_get(project=project, run_id=run_id)
    if not request.htmx:
        return redirect("dashboard:run", project_id=project.id, run_id=run.id)
    context = {"project": project, "run": run} | evals_context(run=run)
    return render(request, "dashboard/_run_evals.html", context)


@login_required
@require_POST
def eval_create(request, project_id, run_id):
    """The "Evaluate" form: the base model and/or checkpoints picked, on the default rows."""
    project = project_get_for_user(user=request.user, project_id=project_id)
    run = run_get(project=project, run_id=run_id)
    wanted = [value for value in request.POST.getlist("model") if value]
    checkpoints = []
    for value in wanted:
        if value == "base":
            continue
        checkpoint = (
            Checkpoint.objects.filter(run=run, pk=int(value)).first() if value.isdigit() else None
        )
        if checkpoint is None:
            messages.error(request, f"Run '{run.name}' has no checkpoint {value}.")
            return redirect("dashboard:run", project_id=project.id, run_id=run.id)
        checkpoints.append(checkpoint)
    try:
        evals = eval_request(run=run, checkpoints=checkpoints, base="base" in wanted)
    except EvalRefused as exc:
        messages.error(request, str(exc))
    else:
        labels = ", ".join(e.model_label for e in evals)
        messages.success(request, f"Evaluating {labels}: progress below.")
    return redirect("dashboard:run", project_id=project.id, run_id=run.id)


@login_required
def eval_detail(request, project_id, run_id, eval_id):
    project = project_get_for_user(user=request.user, project_id=project_id)
    run = run_get(project=project, run_id=run_id)
    evaluation = eval_get(run=run, eval_id=eval_id)
    order = request.GET.get("order") if request.GET.get("order") in ORDERS else "index"
    page = Paginator(eval_examples(evaluation=evaluation, order=order), EXAMPLES_PER_PAGE).get_page(
        request.GET.get("page")
    )
    for example in page:
        example.answers = list(zip(example.completions, example.rewards, strict=False))
    context = {
        "project": project,
        "tab": "runs",
        "run": run,
        "evaluation": evaluation,
        "page": page,
        "order": order,
        "orders": ORDERS,
        "active": evaluation.status in (Eval.Status.QUEUED, Eval.Status.RUNNING),
    }
    return render(request, "dashboard/eval_detail.html", context)
