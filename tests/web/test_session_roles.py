"""A multi-agent session: each turn's role in the sessions API and as a badge on the session
page, the sessions list filtered by role, and the export's role column."""

from __future__ import annotations

import json

import pytest

from webapp.gateway.models import Interaction

pytestmark = pytest.mark.django_db


@pytest.fixture
def game(project, make_run, make_agent, make_session):
    run = make_run(project, name="game", lora_rank=8, roles=["speaker", "listener"])
    agent = make_agent(project, run=run)
    session = make_session(
        agent,
        [
            {"messages": [{"role": "user", "content": "Describe"}], "answer": "red"},
            {"messages": [{"role": "user", "content": "Guess"}], "answer": "apple"},
        ],
    )
    for turn, role in ((0, "speaker"), (1, "listener")):
        Interaction.objects.filter(session=session, turn=turn).update(role=role)
    plain = make_session(agent, [{"messages": [{"role": "user", "content": "Hi"}], "answer": "x"}])
    return session, plain


def test_the_sessions_api_gives_each_turns_role(api, game):
    session, _ = game
    body = api.get(f"/api/v1/sessions/{session.id}/").json()
    assert [t["role"] for t in body["interactions"]] == ["speaker", "listener"]


def test_the_sessions_list_filters_by_role(api, game):
    session, plain = game
    listed = api.get("/api/v1/sessions/?role=listener").json()["results"]
    assert [s["id"] for s in listed] == [str(session.id)]
    assert len(api.get("/api/v1/sessions/").json()["results"]) == 2


def test_the_session_page_marks_each_turn_with_its_role(client, owner, project, game):
    session, _ = game
    client.force_login(owner)
    page = client.get(f"/projects/{project.id}/sessions/{session.id}/").content.decode()
    assert page.count('class="badge role-badge"') == 2
    assert ">speaker</span>" in page and ">listener</span>" in page


def test_the_export_has_a_row_per_role_saying_which(api, game):
    session, _ = game
    body = api.get(f"/api/v1/runs/{session.run_id}/trajectories/export?format=jsonl")
    assert body.status_code == 200
    rows = [json.loads(line) for line in b"".join(body.streaming_content).decode().splitlines()]
    mine = [row for row in rows if row["session_id"].split("#")[0] == str(session.id)]
    assert sorted(row["role"] for row in mine) == ["listener", "speaker"]
    completions = {row["role"]: row["completion"] for row in mine}
    assert completions == {"speaker": "red", "listener": "apple"}


def test_the_run_page_filters_its_sessions_by_role(client, owner, project, game):
    session, plain = game
    client.force_login(owner)
    url = f"/projects/{project.id}/runs/{session.run_id}/"
    page = client.get(url).content.decode()
    assert f"{url}?role=speaker" in page and f"{url}?role=listener" in page
    assert str(session.id)[:8] in page and str(plain.id)[:8] in page
    listener = client.get(f"{url}?role=listener").content.decode()
    assert str(session.id)[:8] in listener and str(plain.id)[:8] not in listener
    unknown = client.get(f"{url}?role=nobody").content.decode()  # not a role: every session
    assert str(session.id)[:8] in unknown and str(plain.id)[:8] in unknown
    Interaction.objects.filter(session=session, role="listener").update(role="speaker")
    empty = client.get(f"{url}?role=listener").content.decode()
    assert "No session of this run has a <b>listener</b> turn yet." in empty
