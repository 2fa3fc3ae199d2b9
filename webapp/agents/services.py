from __future__ import annotations

from webapp.accounts.models import Project
from webapp.agents.models import Agent
from webapp.runs.models import Run


class AgentInvalid(Exception):
    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))


def agent_create(*, project: Project, name: str, run: Run | None = None) -> Agent:
    if run is not None and run.project_id != project.id:
        raise AgentInvalid({"run": ["Run not found."]})
    return Agent.objects.create(project=project, name=name, run=run)


def agent_bind_run(*, agent: Agent, run: Run | None) -> Agent:
    if run is not None and run.project_id != agent.project_id:
        raise AgentInvalid({"run": ["Run not found."]})
    agent.run = run
    agent.save(update_fields=["run"])
    return agent


def agent_delete(*, agent: Agent) -> None:
    agent.delete()
