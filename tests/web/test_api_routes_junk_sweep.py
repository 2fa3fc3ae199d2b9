"""Every REST route and method, on the caller's own objects, with junk bodies and query strings:
a 4xx in the error shape (or a success), never a 500. The targeted cases (which status, which
field) are in test_request_errors.py; this sweep keeps a new route or field from slipping by."""

from __future__ import annotations

import re

import pytest

from tests.web.test_project_isolation import api_routes, path_for, victim  # noqa: F401 (victim: a fixture)

pytestmark = pytest.mark.django_db

RAW_BODIES = [b"{", b"[1, 2]", b'"text"', b"null", b"1e999", b'{"a": NaN}', b"\xff\xfe", b""]
FIELDS = [
    *("name", "mode", "base_model", "config", "dataset", "run", "reward", "expires_at"),
    *("checkpoint", "split", "k", "max_examples", "temperature", "top_p", "max_new_tokens"),
    *("pass_threshold", "step", "base", "score", "comment", "label", "rating", "inference_pool"),
    *("lora_rank", "max_steps", "seed", "rows", "file", "page"),
]
VALUES = [None, [], {}, -1, 10**30, "x" * 5000, True, 1.5, "\x00", {"$gt": 1}, ["a"]]
QUERIES = [
    *("?page=-1", "?page=1e9", "?limit=-5", "?limit=abc", "?cursor=%00", "?since=notadate"),
    *("?step=abc", "?after=zz", "?status=nope", "?run=zz", "?agent=zz", "?format=zz"),
    *("?names=" + "x," * 200, "?from=abc&to=def", "?task_id=" + "y" * 3000),
]
OBJECT_FOR = {
    "dataset_id": "dataset",
    "run_id": "run",
    "checkpoint_id": "checkpoint",
    "eval_id": "evaluation",
    "agent_id": "agent",
    "session_id": "session",
    "key_id": "key",
}


@pytest.mark.parametrize(  # the schema and its docs page take no input
    "route,method", [(r, m) for r, m in api_routes() if not r.startswith(("schema", "docs"))]
)
def test_junk_input_is_never_a_500(api, victim, route, method):  # noqa: F811
    params = re.findall(r"<str:(\w+)>", route)
    path = (
        path_for(route, getattr(victim, OBJECT_FOR[params[-1]])) if params else f"/api/v1/{route}"
    )
    call = getattr(api, method)
    answers = []
    if method in ("post", "put", "patch"):
        answers += [(raw, call(path, raw, content_type="application/json")) for raw in RAW_BODIES]
        answers += [
            ((name, value), call(path, {name: value}, format="json"))
            for name in FIELDS
            for value in VALUES
        ]
    answers += [(query, call(path + query)) for query in QUERIES]
    wrong = [
        (sent, response.status_code, response.content[:300])
        for sent, response in answers
        if response.status_code >= 500
        or (response.status_code >= 400 and set(response.json()) != {"error"})
    ]
    assert not wrong, wrong[:5]
