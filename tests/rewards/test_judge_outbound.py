"""A judge's base_url is screened as each request is sent, through the official openai SDK:
redirects are not followed (a 3xx is an outage, not a hop to the metadata address), and a host
the rules refuse is never contacted."""

from __future__ import annotations

import pytest

from tests.local_http import redirecting, serving
from webapp.rewards.judge import judge_answers

pytestmark = pytest.mark.django_db


@pytest.fixture
def redirecting_judge():
    hits: list[str] = []
    location = "http://169.254.169.254/latest/meta-data/iam/"
    with serving(redirecting(location, hits, status=307)) as url:
        yield f"{url}/v1", hits


def _spec(base_url: str) -> dict:
    return {"type": "judge", "rubric": "Is it right?", "model": "judge", "base_url": base_url}


def test_a_redirect_from_the_judge_is_an_outage_and_is_not_followed(redirecting_judge):
    base_url, hits = redirecting_judge
    result = judge_answers(_spec(base_url), ["user: 2+2?\nassistant: 4"])
    assert result.outage and result.verdict is None
    assert "307" in result.error
    assert hits == ["/v1/chat/completions"]  # asked once, then nothing followed the Location


def test_a_judge_the_rules_refuse_now_is_never_contacted(redirecting_judge, settings):
    base_url, hits = redirecting_judge
    settings.STEEP_OUTBOUND_ALLOW = []  # e.g. the operator took back the loopback allowance
    result = judge_answers(_spec(base_url), ["user: 2+2?\nassistant: 4"])
    assert result.outage and "reward.base_url" in result.error
    assert "STEEP_OUTBOUND_ALLOW" in result.error
    assert hits == []
