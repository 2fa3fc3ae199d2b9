"""Dashboard pages for people's rewards: feedback on a session's page (htmx) and the review
queue of sessions waiting for it. The rule that turns feedback into a reward lives in
``webapp.rewards.services``; these views parse, call it, and render."""

from __future__ import annotations

import math

from django import forms
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from webapp.dashboard.views import _project, _wants_fragment, session_context
from webapp.gateway.selectors import session_get
from webapp.rewards.models import Feedback
from webapp.rewards.selectors import review_queue
from webapp.rewards.services import FeedbackInvalid, feedback_record

REVIEW_PAGE_SIZE = 25


class FeedbackForm(forms.Form):
    rating = forms.ChoiceField(choices=[("", "—"), *Feedback.Rating.choices], required=False)
    score = forms.FloatField(required=False, min_value=0.0, max_value=1.0)
    comment = forms.CharField(required=False, max_length=4000)
    interaction_id = forms.CharField(required=False, max_length=64)

    def clean_score(self):
        score = self.cleaned_data.get("score")
        if score is not None and not math.isfinite(score):
            raise forms.ValidationError("Give a number from 0 to 1.")
        return score


@login_required
@require_POST
def session_feedback(request, project_id, session_id):
    project = _project(request, project_id)
    session = session_get(project=project, session_id=session_id)
    form = FeedbackForm(request.POST)
    error = ""
    if form.is_valid():
        try:
            feedback_record(
                session=session,
                interaction_id=form.cleaned_data["interaction_id"] or None,
                rating=form.cleaned_data["rating"],
                score=form.cleaned_data["score"],
                comment=form.cleaned_data["comment"],
                author=request.user,
            )
        except FeedbackInvalid as exc:
            error = str(exc)
    else:
        error = " ".join(msg for msgs in form.errors.values() for msg in msgs)
    if request.POST.get("from") == "review" and _wants_fragment(request):
        session.refresh_from_db()
        return render(
            request,
            "dashboard/_review_row.html",
            {"project": project, "item": None, "done": session, "error": error},
            status=400 if error else 200,
        )
    if not _wants_fragment(request):
        return redirect("dashboard:session", project.id, session.id)
    session = session_get(project=project, session_id=session_id)  # its new reward total
    context = session_context(project, session, request.POST.get("page")) | {
        "feedback_error": error
    }
    return render(request, "dashboard/_session_live.html", context, status=400 if error else 200)


@login_required
def review(request, project_id):
    project = _project(request, project_id)
    page = Paginator(review_queue(project=project), REVIEW_PAGE_SIZE).get_page(
        request.GET.get("page")
    )
    return render(
        request,
        "dashboard/review.html",
        {"project": project, "tab": "review", "page": page, "items": list(page.object_list)},
    )
