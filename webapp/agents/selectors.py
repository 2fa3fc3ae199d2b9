from __future__ import annotations

from django.db.models import QuerySet
from django.http import Http404

from webapp.accounts.models import Project
from webapp.accounts.selectors import parse_uuid
from webapp.agents.models import Agent


def agent_list(*, project: Project, run_id=None) -> QuerySet[Agent]:
    agents = Agent.objects.filter(project=project).select_related("run")
    if run_id:
        agents = agents.filter(run_id=parse_uuid(run_id))
    return agents.order_by("-created_at")


def agent_get(*, project: Project, agent_id) -> Agent:
    agent = (
        Agent.objects.filter(project=project, pk=parse_uuid(agent_id)).select_related("run").first()
    )
    if agent is None:
        raise Http404("Agent not found.")
    return agent
