"""Dashboard pages. Each view parses, calls one service or selector, and renders.

With htmx a view answers the fragment it owns (``request.htmx``); without
JavaScript the same URLs serve whole pages and forms post normally.
"""

from __future__ import annotations

import json

from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render, resolve_url
from django.views.decorators.http import require_http_methods, require_POST
from django_htmx.http import HttpResponseClientRedirect

from webapp.accounts.selectors import (
    api_key_get,
    api_key_list,
    project_get_for_user,
    project_list_for_user,
)
from webapp.accounts.services import (
    ProjectNameTaken,
    api_key_create,
    api_key_revoke,
    project_create,
)
from webapp.agents.selectors import agent_get, agent_list
from webapp.agents.services import AgentInvalid, agent_create
from webapp.agents.snippets import openai_snippet
from webapp.dashboard import charts, checkpoint_views, conversation, eval_views
from webapp.dashboard.forms import AgentForm, DatasetForm, KeyForm, ProjectForm, RunForm, SignupForm
from webapp.dashboard.presets import preset_named, run_presets
from webapp.datasets.selectors import dataset_get, dataset_list
from webapp.datasets.services import (
    DatasetInUse,
    DatasetInvalid,
    DatasetNameTaken,
    DatasetTooLarge,
    dataset_create,
    dataset_delete,
)
from webapp.gateway.models import Session
from webapp.gateway.selectors import (
    admission_state,
    interaction_list,
    session_count,
    session_get,
    session_interactions,
    session_list,
)
from webapp.pools.selectors import pool_list
from webapp.rewards.secrets import redact_config
from webapp.rewards.selectors import reward_summary, session_feedback
from webapp.runs.ledger import run_ledger_for_page
from webapp.runs.selectors import (
    checkpoint_for_step,
    checkpoint_get,
    known_models,
    metric_latest,
    metric_points,
    metric_step_times,
    metric_values,
    project_checkpoint_list,
    run_event_list,
    run_get,
    run_last_restart,
    run_list,
    run_list_with_reward,
)
from webapp.runs.services import (
    ExportRefused,
    IllegalTransition,
    RunInvalid,
    checkpoint_export_request,
    run_clone,
    run_create,
    run_start,
    run_stop,
)


def _render(request, template: str, fragment: str | None, context: dict, status: int = 200):
    """Full page, or only ``fragment`` when htmx asked for it."""
    name = fragment if fragment and _wants_fragment(request) else template
    return render(request, name, context, status=status)


def _wants_fragment(request) -> bool:
    return bool(request.htmx and not request.htmx.boosted)


def _redirect(request, *args, **kwargs):
    """Navigate after a successful form post; htmx needs HX-Redirect, or it would swap the next page into the form."""
    if request.htmx:
        return HttpResponseClientRedirect(resolve_url(*args, **kwargs))
    return redirect(*args, **kwargs)


def _project(request, project_id):
    return project_get_for_user(user=request.user, project_id=project_id)


@require_http_methods(["GET", "POST"])
def signup(request):
    form = SignupForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = form.save()
        login(request, user)
        return redirect("dashboard:projects")
    return render(request, "registration/signup.html", {"form": form})


@login_required
def home(request):
    return redirect("dashboard:projects")


@login_required
@require_http_methods(["GET", "POST"])
def projects(request):
    form = ProjectForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            project = project_create(name=form.cleaned_data["name"], owner=request.user)
        except ProjectNameTaken:
            form.add_error("name", "A project with this name already exists.")
        else:
            return _redirect(request, "dashboard:runs", project_id=project.id)
    context = {"projects": project_list_for_user(user=request.user), "form": form}
    return _render(request, "dashboard/projects.html", "dashboard/_projects_panel.html", context)


@login_required
def project_detail(request, project_id):
    return redirect("dashboard:runs", project_id=_project(request, project_id).id)


# --- API keys -----------------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def keys(request, project_id):
    project = _project(request, project_id)
    form = KeyForm(request.POST or None)
    created = None
    if request.method == "POST" and form.is_valid():
        key, plaintext = api_key_create(
            project=project, name=form.cleaned_data["name"], user=request.user
        )
        created = {"key": key, "plaintext": plaintext}
        form = KeyForm()
    context = {
        "project": project,
        "tab": "keys",
        "keys": api_key_list(project=project),
        "form": form,
        "created": created,
    }
    return _render(request, "dashboard/keys.html", "dashboard/_keys_panel.html", context)


@login_required
@require_POST
def key_revoke(request, project_id, key_id):
    project = _project(request, project_id)
    api_key_revoke(key=api_key_get(project=project, key_id=key_id))
    if request.htmx:
        return keys(_as_get(request), project_id)
    messages.success(request, "Key revoked.")
    return redirect("dashboard:keys", project_id=project.id)


def _as_get(request):
    request.method = "GET"
    request.POST = request.POST.copy()
    request.POST.clear()
    return request


# --- Datasets -----------------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def datasets(request, project_id):
    project = _project(request, project_id)
    form = DatasetForm(request.POST or None, request.FILES or None)
    status = 200
    if request.method == "POST" and form.is_valid():
        try:
            dataset = dataset_create(project=project, user=request.user, **form.cleaned_data)
        except DatasetTooLarge as exc:
            form.add_error("file", str(exc))
            status = 413
        except DatasetNameTaken:
            form.add_error("name", "A dataset with this name already exists.")
            status = 400
        except DatasetInvalid as exc:
            for error in exc.report.errors:
                form.add_error("file", f"line {error['line']}: {error['message']}")
            more = exc.report.bad_lines - len(exc.report.errors)
            if more > 0:
                form.add_error("file", f"… and {more} more invalid line(s). Nothing was stored.")
            status = 400
        else:
            messages.success(request, f"Uploaded {dataset.row_count} rows.")
            return _redirect(
                request, "dashboard:dataset", project_id=project.id, dataset_id=dataset.id
            )
    elif request.method == "POST":
        status = 400
    context = {
        "project": project,
        "tab": "datasets",
        "datasets": dataset_list(project=project),
        "form": form,
    }
    return _render(
        request, "dashboard/datasets.html", "dashboard/_datasets_panel.html", context, status=status
    )


@login_required
@require_http_methods(["GET", "POST"])
def dataset_detail(request, project_id, dataset_id):
    project = _project(request, project_id)
    dataset = dataset_get(project=project, dataset_id=dataset_id)
    if request.method == "POST":
        try:
            dataset_delete(dataset=dataset)
        except DatasetInUse as exc:
            messages.error(request, str(exc))
            return redirect("dashboard:dataset", project_id=project.id, dataset_id=dataset.id)
        messages.success(request, f"Deleted dataset {dataset.name}.")
        return redirect("dashboard:datasets", project_id=project.id)
    return render(
        request,
        "dashboard/dataset_detail.html",
        {"project": project, "tab": "datasets", "dataset": dataset},
    )


# --- Runs ---------------------------------------------------------------------------------


@login_required
def runs(request, project_id):
    project = _project(request, project_id)
    context = {"project": project, "tab": "runs", "runs": run_list_with_reward(project=project)}
    return _render(request, "dashboard/runs.html", "dashboard/_runs_table.html", context)


@login_required
@require_http_methods(["GET", "POST"])
def run_new(request, project_id):
    project = _project(request, project_id)
    project_datasets = dataset_list(project=project)
    pools = list(pool_list())
    presets = run_presets(datasets=project_datasets, pools=pools)
    preset = preset_named(presets, request.GET.get("preset"))
    form = RunForm(
        request.POST or None,
        datasets=project_datasets,
        models=known_models(project=project),
        pools=pools,
        checkpoints=project_checkpoint_list(project=project),
        preset=preset,
    )
    if request.method == "POST" and form.is_valid():
        dataset = None
        if form.cleaned_data.get("dataset"):
            dataset = dataset_get(project=project, dataset_id=form.cleaned_data["dataset"])
        try:
            run = run_create(
                project=project,
                name=form.cleaned_data["name"],
                config=form.cleaned_data["config"],
                dataset=dataset,
            )
        except RunInvalid as exc:
            for field, msgs in exc.errors.items():
                for message in msgs:
                    form.add_error(field if field in form.fields else None, message)
        else:
            return redirect("dashboard:run", project_id=project.id, run_id=run.id)
    status = 400 if request.method == "POST" else 200
    context = {
        "project": project,
        "tab": "runs",
        "form": form,
        "datasets": project_datasets,
        "presets": presets,
        "preset": preset,
        "unknown_preset": request.GET.get("preset") if preset is None else None,
        "preset_values": {p.slug: form.preset_values(p) for p in presets},
    }
    return render(request, "dashboard/run_new.html", context, status=status)


@login_required
def run_detail(request, project_id, run_id):
    project = _project(request, project_id)
    run = run_get(project=project, run_id=run_id)
    context = {
        "project": project,
        "tab": "runs",
        "run": run,
        "events": run_event_list(run=run)[:30],
        "ledger": run_ledger_for_page(run),
        "restart": run_last_restart(run=run),
        "admission": admission_state(run),
        "progress": _run_progress(run),
    }
    if _wants_fragment(request) and request.GET.get("panel") == "rewards":  # polled, as below
        context["rewards"] = reward_summary(run=run)
        return render(request, "dashboard/_rewards_panel.html", context)
    if _wants_fragment(request):  # the polled status line: no chart data
        return render(request, "dashboard/_run_status.html", context)
    roles = list(run.config.get("roles") or ())
    role = request.GET.get("role", "")
    if role not in roles:  # the sessions list's filter: one of the run's roles, or none
        role = ""
    stride = charts.chart_stride(run.step)
    data = charts.series(metric_points(run=run, stride=stride))
    rules = {"config": charts.client_config(), "maxSteps": run.config.get("max_steps")}
    context |= {
        "layout": charts.chart_layout(data["series"], roles),
        "chart_data": data | rules | {"mode": run.mode},
        "chart_stride": stride,
        "latest_metrics": charts.latest_values(metric_latest(run=run)),
        "agents": agent_list(project=project, run_id=run.id),
        "sessions": session_list(project=project, run_id=run.id, role=role or None)[:10],
        "roles": roles,
        "role": role,
        "settings": redact_config(run.config),
        "rewards": reward_summary(run=run),
    }
    context |= checkpoint_views.checkpoints_context(run=run) | eval_views.evals_context(run=run)
    return render(request, "dashboard/run_detail.html", context)


def _run_progress(run) -> charts.Progress:
    """The status line's step, bar and ETA (or pace: steps/min, trajectories/min)."""
    step_times = metric_step_times(run=run, last=charts.ETA_WINDOW + 1)
    trajectories: list[float] = []
    if step_times and run.status == "running":  # the pace's trajectories per step
        since = step_times[0][0] - 1
        trajectories = metric_values(run=run, name="rollout/num_trajectories", since_step=since)
    return charts.progress(
        step=run.step,
        max_steps=run.config.get("max_steps"),
        status=run.status,
        step_times=step_times,
        mode=run.mode,
        trajectories=trajectories,
        started_at=run.started_at,
    )


@login_required
@require_POST
def run_again(request, project_id, run_id):
    """ "Run again": a draft copy of the run (its settings and dataset), optionally starting
    from one of its checkpoints (``from_checkpoint``: its step), then the copy's page."""
    project = _project(request, project_id)
    run = run_get(project=project, run_id=run_id)
    checkpoint = None
    step = request.POST.get("from_checkpoint", "")
    if step:
        checkpoint = checkpoint_for_step(run=run, step=int(step)) if step.isdigit() else None
        if checkpoint is None:
            messages.error(request, f"Run '{run.name}' has no checkpoint at step {step}.")
            return redirect("dashboard:run", project_id=project.id, run_id=run.id)
    try:
        clone = run_clone(run=run, checkpoint=checkpoint)
    except RunInvalid as exc:
        messages.error(request, f"Could not copy the run: {exc}")
        return redirect("dashboard:run", project_id=project.id, run_id=run.id)
    messages.success(request, f"Copied '{run.name}' as a draft: check its settings, then start it.")
    return redirect("dashboard:run", project_id=project.id, run_id=clone.id)


@login_required
@require_POST
def checkpoint_export(request, project_id, run_id, checkpoint_id):
    """The checkpoint list's "Export" button: a worker writes a standalone model folder."""
    project = _project(request, project_id)
    run = run_get(project=project, run_id=run_id)
    checkpoint = checkpoint_get(run=run, checkpoint_id=checkpoint_id)
    try:
        checkpoint = checkpoint_export_request(checkpoint=checkpoint)
    except ExportRefused as exc:
        messages.error(request, str(exc))
    else:
        if checkpoint.export_status == checkpoint.ExportStatus.DONE:
            messages.success(request, f"Already exported to {checkpoint.export_path}.")
        else:
            messages.success(
                request, f"Exporting the checkpoint at step {checkpoint.step}: reload to follow it."
            )
    return redirect("dashboard:run", project_id=project.id, run_id=run.id)


@login_required
@require_POST
def run_action(request, project_id, run_id, action):
    project = _project(request, project_id)
    run = run_get(project=project, run_id=run_id)
    service = {"start": run_start, "stop": run_stop}.get(action)
    if service is None:
        raise Http404
    try:
        service(run=run)
    except IllegalTransition as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Run {action} requested.")
    return redirect("dashboard:run", project_id=project.id, run_id=run.id)


# --- Agents -------------------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def agents(request, project_id):
    project = _project(request, project_id)
    project_runs = run_list(project=project)
    form = AgentForm(request.POST or None, runs=project_runs)
    if request.method == "POST" and form.is_valid():
        run = (
            run_get(project=project, run_id=form.cleaned_data["run"])
            if form.cleaned_data["run"]
            else None
        )
        try:
            agent = agent_create(
                project=project,
                name=form.cleaned_data["name"],
                run=run,
                role=form.cleaned_data.get("role") or "",
            )
        except AgentInvalid as exc:
            for name, errors in exc.errors.items():
                form.add_error(name if name in form.fields else None, " ".join(errors))
        else:
            return redirect("dashboard:agent", project_id=project.id, agent_id=agent.id)
    context = {
        "project": project,
        "tab": "agents",
        "agents": agent_list(project=project),
        "form": form,
    }
    return _render(request, "dashboard/agents.html", "dashboard/_agents_panel.html", context)


SESSION_FILTERS = ["open", "ready", "trained", "unrewarded", "expired"]


@login_required
def agent_detail(request, project_id, agent_id):
    project = _project(request, project_id)
    agent = agent_get(project=project, agent_id=agent_id)
    status = request.GET.get("status", "")
    if status not in SESSION_FILTERS:
        status = ""
    context = {
        "project": project,
        "tab": "agents",
        "agent": agent,
        "snippet": openai_snippet(base_url=agent.base_url),
        "open_count": session_count(project=project, agent_id=agent.id, status=Session.Status.OPEN),
        "sessions": session_list(project=project, agent_id=agent.id, status=status or None)[:20],
        "status": status,
        "status_filters": SESSION_FILTERS,
    }
    if not _wants_fragment(request):  # the polled fragment leaves out the turns: they are heavy
        recent = interaction_list(project=project, agent_id=agent.id)[:20]
        context["interactions"] = [conversation.interaction_preview(i) for i in recent]
    return _render(request, "dashboard/agent_detail.html", "dashboard/_agent_live.html", context)


# --- Sessions -----------------------------------------------------------------------------


def session_context(project, session, page: str | None = None) -> dict:
    """What the session page and its live fragment show (the feedback views render it too):
    one page of its turns (``?page=``; the latest by default)."""
    interactions = session_interactions(session=session)
    decode = conversation.token_decoder(session.run.base_model) if session.run else None
    shown = conversation.Page.of(len(interactions), page)
    return {
        "project": project,
        "tab": "agents" if session.agent_id else "runs",
        "session": session,
        "turns": conversation.conversation(interactions, decode=decode, page=shown),
        "page": shown,
        "legend": conversation.legend(interactions),
        "metadata_json": json.dumps(session.metadata, indent=2, sort_keys=True),
        "decoded": decode is not None,
        "feedback": session_feedback(session=session),
        "hint": conversation.hint_view(session, decode),
    }


@login_required
def session_detail(request, project_id, session_id):
    project = _project(request, project_id)
    context = session_context(
        project, session_get(project=project, session_id=session_id), request.GET.get("page")
    )
    return _render(
        request, "dashboard/session_detail.html", "dashboard/_session_live.html", context
    )
