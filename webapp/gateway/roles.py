"""Which role of a multi-agent run a request plays (``RunConfig.roles``).

A run with roles trains one LoRA adapter per role on its base model. A request names its role
with ``model: "policy/<role>"``; otherwise the agent's bound role (``Agent.role``) is used. A
run without roles ignores ``model``, as the gateway always has. Pure: no I/O, no Django models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from webapp.gateway.errors import GatewayError, bad_request

POLICY_MODEL = "policy"
ROLE_MODEL_PREFIX = POLICY_MODEL + "/"


def run_roles(config: Mapping[str, Any] | None) -> list[str]:
    """A stored run config's roles; [] for a one-policy run."""
    roles = (config or {}).get("roles") or []
    return [str(role) for role in roles]


def named_role(model: str | None) -> str:
    """The role a request's ``model`` names (``"policy/<role>"``); "" when it names none."""
    if model and model.startswith(ROLE_MODEL_PREFIX):
        return model[len(ROLE_MODEL_PREFIX) :]
    return ""


def role_models(roles: list[str]) -> list[str]:
    """The model ids ``GET /models`` lists for a run: ``policy``, and ``policy/<role>`` each."""
    return [POLICY_MODEL, *(ROLE_MODEL_PREFIX + role for role in roles)]


def turn_role(*, roles: list[str], model: str | None, agent_role: str) -> str:
    """The role a request plays: the one its ``model`` names, else the agent's; "" for a run
    without roles. A 404 ``model_not_found`` for a role the run lacks, a 400 when none is given."""
    if not roles:
        return ""
    listed = ", ".join(roles)
    named = named_role(model)
    if named:
        if named not in roles:
            raise GatewayError(
                404,
                f"The model '{model}' does not exist: this run trains roles {listed}; "
                f'send model "policy/<role>" with one of them.',
                code="model_not_found",
                param="model",
            )
        return named
    if agent_role in roles:
        return agent_role
    raise bad_request(
        f'This run trains roles {listed}: send model "policy/<role>" or bind the agent to a role.',
        param="model",
        code="missing_role",
    )
