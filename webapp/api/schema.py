"""What drf_spectacular needs beyond introspection: paged lists said to be paged, and the gateway.

``AutoSchema`` documents a view's GET list as the page it answers (``Pagination``: count, next,
previous, results; ``page`` and ``page_size``) and says so in the operation's description.
``add_agent_gateway`` (a postprocessing hook) puts the agent gateway's endpoints, which are not
DRF views, first in the schema (``webapp.gateway.openapi``).
"""

from __future__ import annotations

from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.plumbing import get_doc

from webapp.api.pagination import Pagination
from webapp.api.views import ProjectAPIView
from webapp.gateway import openapi as gateway


class AutoSchema(SpectacularAutoSchema):
    def _get_paginator(self):
        # A POST that answers a list (evals started for several checkpoints) is not paged.
        return super()._get_paginator() if self.method == "GET" else None

    def get_description(self) -> str:
        description = super().get_description() or ""
        if description == get_doc(ProjectAPIView):  # the base class's, not this view's
            description = ""
        if self.method == "GET" and self._is_list_view() and self._get_paginator() is not None:
            description = f"{description}\n\n{Pagination.SCHEMA_NOTE}".strip()
        return description


def add_agent_gateway(result: dict, generator, request, public) -> dict:
    """The gateway's path items, security schemes and schemas, its tag listed first."""
    result["paths"] = {**gateway.path_items(), **result.get("paths", {})}
    components = result.setdefault("components", {})
    components.setdefault("securitySchemes", {}).update(gateway.SECURITY_SCHEMES)
    components.setdefault("schemas", {}).update(gateway.COMPONENTS)
    # Swagger UI lists the tags in this order: what an agent calls comes first.
    names = [
        name
        for item in result["paths"].values()
        for operation in item.values()
        if isinstance(operation, dict)
        for name in operation.get("tags", [])
    ]
    result["tags"] = [{"name": gateway.TAG, "description": gateway.TAG_DESCRIPTION}] + [
        {"name": name} for name in dict.fromkeys(names) if name != gateway.TAG
    ]
    return result
