"""Dashboard views parse, call one service or selector, and render: the ORM stays in
services (writes, rules such as ``ProjectNameTaken``) and selectors (reads)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "webapp" / "dashboard"

# Manager and queryset methods; a view that calls one is running its own query.
QUERYSET_METHODS = {
    "objects",
    "all",
    "filter",
    "exclude",
    "order_by",
    "exists",
    "count",
    "aggregate",
    "annotate",
    "select_related",
    "prefetch_related",
    "values_list",
    "select_for_update",
    "get_or_create",
    "update_or_create",
    "bulk_create",
}


@pytest.mark.parametrize("module", ["views.py", "conversation.py"])
def test_dashboard_modules_leave_queries_to_selectors_and_services(module):
    tree = ast.parse((DASHBOARD / module).read_text())
    queries = [
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in QUERYSET_METHODS
    ]
    assert not queries, f"webapp/dashboard/{module} queries the ORM itself: {queries}"
