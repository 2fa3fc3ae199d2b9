"""Many agents at once: every request is served and recorded exactly once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from webapp.gateway.models import Interaction, Session

pytestmark = pytest.mark.django_db(transaction=True)


def test_concurrent_completions_are_all_served_and_recorded(gw):
    _, key = gw.start_session()

    def complete(args: tuple[str, int]) -> int:
        bearer, i = args
        response = gw.http.post(
            gw.base_url + "/chat/completions",
            json={"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 3},
            headers={"Authorization": f"Bearer {bearer}"},
        )
        return response.status_code

    jobs = [(gw.key, i) for i in range(16)] + [(key, i) for i in range(8)]
    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(complete, jobs))

    assert codes == [200] * len(jobs)
    assert Session.objects.filter(one_turn=True).count() == 16
    assert Interaction.objects.count() == 24
    session = Session.objects.get(one_turn=False)
    assert session.interaction_count == 8
    turns = sorted(session.interactions.values_list("turn", flat=True))
    assert turns == list(range(8))
