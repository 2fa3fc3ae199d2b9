from __future__ import annotations

from webapp.accounts.models import Project
from webapp.agents.models import Agent
from webapp.runs.models import Run


class AgentInvalid(Exception):
    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))


def _check_role(run: Run | None, role: str) -> None:
    """An agent's role must be one of its run's roles (``RunConfig.roles``)."""
    if not role:
        return
    roles = list((run.config or {}).get("roles") or []) if run is not None else []
    if role in roles:
        return
    if not roles:
        raise AgentInvalid(
            {"role": ["This agent's run trains one policy, without roles: leave role empty."]}
        )
    raise AgentInvalid(
        {"role": [f"'{role}' is not a role of this run; its roles: {', '.join(roles)}."]}
    )


def agent_create(*, project: Project, name: str, run: Run | None = None, role: str = "") -> Agent:
    if run is not None and run.project_id != project.id:
        raise AgentInvalid({"run": ["Run not found."]})
    _check_role(run, role)
    return Agent.objects.create(project=project, name=name, run=run, role=role)


def agent_bind_run(*, agent: Agent, run: Run | None, role: str | None = None) -> Agent:
    """Bind the agent to ``run`` and, when given, ``role``; a role the new run lacks is cleared."""
    if run is not None and run.project_id != agent.project_id:
        raise AgentInvalid({"run": ["Run not found."]})
    if role is None:
        roles = (run.config or {}).get("roles") or [] if run is not None else []
        role = agent.role if agent.role in roles else ""
    _check_role(run, role)
    agent.run, agent.role = run, role
    agent.save(update_fields=["run", "role"])
    return agent


def agent_delete(*, agent: Agent) -> None:
    agent.delete()
