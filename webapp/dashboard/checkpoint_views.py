"""The run page's checkpoint list as a fragment: polled while an export runs, so its
"exporting…" turns into the download link without a reload."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render

from webapp.accounts.selectors import project_get_for_user
from webapp.runs.models import Checkpoint
from webapp.runs.selectors import checkpoint_list, run_get


def checkpoints_context(*, run) -> dict:
    checkpoints = list(checkpoint_list(run=run)[:20])
    return {
        "checkpoints": checkpoints,
        "checkpoints_exporting": any(
            c.export_status == Checkpoint.ExportStatus.RUNNING for c in checkpoints
        ),
    }


@login_required
def run_checkpoints(request, project_id, run_id):
    project = project_get_for_user(user=request.user, project_id=project_id)
    run = run_get(project=project, run_id=run_id)
    if not request.htmx:
        return redirect("dashboard:run", project_id=project.id, run_id=run.id)
    context = {"project": project, "run": run} | checkpoints_context(run=run)
    return render(request, "dashboard/_run_checkpoints.html", context)
