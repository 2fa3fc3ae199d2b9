"""A multi-agent (roles) run for the gateway tests, served by the canned-answer ``FakeEngine``
that records each /generate request (so a test reads the ``lora_path`` a turn was sent with)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.test_inference_servers import FakeEngine

ROLES = ["speaker", "listener"]


@pytest.fixture
def fake_engine() -> Iterator[FakeEngine]:
    fake = FakeEngine()
    yield fake
    fake.close()


@pytest.fixture
def roles_gw(make_gateway, project, api_key, fake_engine):
    """An agent (no role bound) of a running two-role LoRA run at policy version 3."""
    from webapp.runs.models import Run

    gw = make_gateway(project, api_key, servers=[fake_engine.url], lora_rank=8, roles=ROLES)
    Run.objects.filter(pk=gw.run.pk).update(weight_version=3)
    return gw


def play_turn(client, model: str, messages: list) -> str:
    """One chat turn as ``model`` (``policy/<role>``), appended to ``messages`` with a next
    user message; the reply's id."""
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    messages += [reply.choices[0].message, {"role": "user", "content": "Next"}]
    return reply.id
