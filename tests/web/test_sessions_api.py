"""REST over recorded sessions: list, inspect, and a run's trajectories as JSON lines."""

from __future__ import annotations

import json
import uuid
import warnings
from types import SimpleNamespace

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import AsyncClient
from django.test.utils import CaptureQueriesContext

from rl_core.types import Trajectory
from webapp.gateway.models import Session
from webapp.gateway.selectors import session_trajectories

pytestmark = pytest.mark.django_db

S, T = Session.Status, Session.Trajectory
EXTRA_KEYS = {"agent_id", "task_id", "status", "trajectory"}


@pytest.fixture
def recorded(project, other_project, make_run, make_agent, make_session, tokenizer_dir):
    """``project``: two runs, three agents, six sessions in every state; ``other_project``: one of its own."""
    run = make_run(project, name="online", base_model=str(tokenizer_dir))
    run2 = make_run(project, name="second", base_model=str(tokenizer_dir))
    solver = make_agent(project, name="solver", run=run)
    critic = make_agent(project, name="critic", run=run)
    late = make_agent(project, name="late", run=run2)
    user = {"role": "user"}
    multi = make_session(
        solver,
        [
            {"messages": [user | {"content": "What is 2 + 2?"}], "answer": "4", "versions": 3},
            {
                "messages": [user | {"content": "And times 3?"}],
                "answer": "That makes 12.",
                "versions": (3, 4, 6),
                "reward": 1.0,
            },
        ],
        task_id="arith-1",
        metadata={"split": "train"},
        admitted_version=3,
    )
    multi.interactions.filter(turn=0).update(reward=0.5)
    open_ = make_session(
        solver,
        [{"messages": [user | {"content": "Name a prime."}], "answer": "7", "versions": 4}],
        status=S.OPEN,
        trajectory=T.PENDING,
        task_id="primes",
    )
    trained = make_session(
        critic,
        [{"messages": [user | {"content": "Is 9 prime?"}], "answer": "No.", "reward": 0.0}],
        trajectory=T.TRAINED,
        task_id="primes",
    )
    unrewarded = make_session(
        solver,
        [{"messages": [user | {"content": "Say hi."}], "answer": "hi"}],
        trajectory=T.UNREWARDED,
    )
    rewritten = make_session(
        solver,
        [
            {"messages": [user | {"content": "Count to 3."}], "answer": "1 2 3", "versions": 4},
            {
                "messages": [user | {"content": "Count to 4, fresh."}],
                "answer": "1 2 3 4",
                "versions": 5,
                "reward": 1.0,
                "rewrite": True,
            },
        ],
        trajectory=T.READY,
    )
    elsewhere = make_session(
        late, [{"messages": [user | {"content": "Hello?"}], "answer": "Hi.", "reward": 0.25}]
    )
    other_run = make_run(other_project, name="rival-run", base_model=str(tokenizer_dir))
    secret = make_session(
        make_agent(other_project, name="rival-agent", run=other_run),
        [{"messages": [user | {"content": "secret prompt"}], "answer": "secret", "reward": 1.0}],
        task_id="rival-task",
    )
    return SimpleNamespace(
        run=run,
        run2=run2,
        solver=solver,
        critic=critic,
        late=late,
        multi=multi,
        open=open_,
        trained=trained,
        unrewarded=unrewarded,
        rewritten=rewritten,
        elsewhere=elsewhere,
        other_run=other_run,
        secret=secret,
    )


def ids(response) -> list[str]:
    assert response.status_code == 200, response.content[:500]
    return [row["id"] for row in response.json()["results"]]


def export(client, run, query: str = "", **headers) -> list[dict]:
    response = client.get(f"/api/v1/runs/{run.id}/trajectories.jsonl{query}", **headers)
    assert response.status_code == 200, response.content[:500]
    assert response.streaming
    assert response["Content-Type"] == "application/x-ndjson"
    body = b"".join(response.streaming_content).decode()
    assert body == "" or body.endswith("\n")
    return [json.loads(line) for line in body.splitlines()]


def expected_lines(*sessions) -> list[dict]:
    rows = []
    for session in sessions:
        for trajectory in session_trajectories(session):
            rows.append(
                trajectory.to_dict()
                | {
                    "agent_id": str(session.agent_id),
                    "task_id": session.task_id,
                    "status": session.status,
                    "trajectory": session.trajectory,
                }
            )
    return rows


# --- list -----------------------------------------------------------------------------------


def test_list_returns_the_projects_sessions_newest_first(api, recorded):
    r = recorded
    response = api.get("/api/v1/sessions/")
    assert ids(response) == [
        str(s.id) for s in (r.elsewhere, r.rewritten, r.unrewarded, r.trained, r.open, r.multi)
    ]
    row = response.json()["results"][-1]
    assert row == {
        "id": str(r.multi.id),
        "agent": str(r.solver.id),
        "run": str(r.run.id),
        "task_id": "arith-1",
        "metadata": {"split": "train"},
        "status": "ended",
        "trajectory": "ready",
        "one_turn": False,
        "interaction_count": 2,
        "reward": 1.5,
        "admitted_version": 3,
        "trained_version": None,
        "hint": "",
        "created_at": row["created_at"],
        "last_activity_at": row["last_activity_at"],
        "ended_at": row["ended_at"],
    }
    assert response.json()["count"] == 6


def test_list_reward_is_null_without_any_reward(api, recorded):
    rows = {row["id"]: row for row in api.get("/api/v1/sessions/").json()["results"]}
    assert rows[str(recorded.unrewarded.id)]["reward"] is None
    assert rows[str(recorded.trained.id)]["reward"] == 0.0


@pytest.mark.parametrize(
    "query,expected",
    [
        ("agent={solver}", ["rewritten", "unrewarded", "open", "multi"]),
        ("agent={critic}", ["trained"]),
        ("run={run2}", ["elsewhere"]),
        ("run={run}&agent={critic}", ["trained"]),
        ("status=open", ["open"]),
        ("status=pending", ["open"]),
        ("status=ended", ["elsewhere", "rewritten", "unrewarded", "trained", "multi"]),
        ("status=ready", ["elsewhere", "rewritten", "multi"]),
        ("status=trained", ["trained"]),
        ("status=unrewarded", ["unrewarded"]),
        ("status=expired", []),
        ("agent={solver}&status=ready", ["rewritten", "multi"]),
        ("run={run2}&status=trained", []),
        ("status=", ["elsewhere", "rewritten", "unrewarded", "trained", "open", "multi"]),
    ],
)
def test_list_filters_by_agent_run_and_status(api, recorded, query, expected):
    query = query.format(
        solver=recorded.solver.id,
        critic=recorded.critic.id,
        run=recorded.run.id,
        run2=recorded.run2.id,
    )
    response = api.get(f"/api/v1/sessions/?{query}")
    assert ids(response) == [str(getattr(recorded, name).id) for name in expected]


@pytest.mark.parametrize("name", ["agent", "run"])
@pytest.mark.parametrize("bad", ["not-a-uuid", "123", "%27%3B--", "None"])
def test_list_with_a_malformed_filter_id_is_400(api, recorded, api_error, name, bad):
    error = api_error(api.get(f"/api/v1/sessions/?{name}={bad}"), 400)
    assert list(error["fields"]) == [name]


def test_list_with_an_unknown_status_is_400_naming_the_choices(api, recorded, api_error):
    error = api_error(api.get("/api/v1/sessions/?status=finished"), 400)
    assert "ready" in " ".join(error["fields"]["status"])
    assert "open" in " ".join(error["fields"]["status"])


def test_list_filtered_by_unknown_or_other_projects_ids_is_empty(api, recorded):
    for query in (
        f"agent={uuid.uuid4()}",
        f"run={uuid.uuid4()}",
        f"run={recorded.other_run.id}",
        f"agent={recorded.secret.agent_id}",
    ):
        response = api.get(f"/api/v1/sessions/?{query}")
        assert ids(response) == [], query


def test_list_is_paginated(api, recorded):
    first = api.get("/api/v1/sessions/?page_size=4").json()
    assert first["count"] == 6 and len(first["results"]) == 4 and first["next"]
    second = api.get(first["next"]).json()
    assert len(second["results"]) == 2 and second["next"] is None
    seen = {row["id"] for row in first["results"] + second["results"]}
    assert len(seen) == 6


def test_lists_never_include_other_projects_sessions(api, other_api, recorded):
    mine = api.get("/api/v1/sessions/").content.decode()
    assert str(recorded.secret.id) not in mine and "rival" not in mine
    theirs = other_api.get("/api/v1/sessions/")
    assert ids(theirs) == [str(recorded.secret.id)]
    for status in [*S.values, *T.values]:
        body = other_api.get(f"/api/v1/sessions/?status={status}").content.decode()
        assert str(recorded.multi.id) not in body


def test_list_needs_a_key(anon_api, recorded, api_error):
    api_error(anon_api.get("/api/v1/sessions/"), 401)


# --- detail ---------------------------------------------------------------------------------


def test_detail_has_every_turn_token_exact(api, recorded):
    session = recorded.multi
    body = api.get(f"/api/v1/sessions/{session.id}/").json()
    assert body["id"] == str(session.id) and body["reward"] == 1.5
    assert body["status"] == "ended" and body["trajectory"] == "ready"
    assert [t["turn"] for t in body["interactions"]] == [0, 1]
    for turn, interaction in zip(
        body["interactions"], session.interactions.order_by("turn"), strict=True
    ):
        assert turn["id"] == interaction.id
        assert turn["messages"] == interaction.messages
        assert turn["input_ids"] == interaction.input_ids
        assert turn["response"] == interaction.response
        assert turn["chosen"] == 0
        assert turn["reward"] == interaction.reward
        assert turn["prefix_reused"] == interaction.prefix_reused
        assert turn["latency_ms"] == interaction.latency_ms
        assert turn["created_at"]
        [choice] = turn["choices"]
        out = interaction.outputs[0]
        assert choice == {
            "output_ids": out["output_ids"],
            "logprobs": out["logprobs"],
            "versions": out["versions"],
            "finish_reason": "stop",
            "text": out["text"],
            "aborted": False,
        }
        assert turn["aborted"] is False
    second = body["interactions"][1]
    assert second["prefix_reused"] is True
    assert second["messages"][-1] == {"role": "user", "content": "And times 3?"}
    assert second["choices"][0]["versions"] == [3] * 6 + [4] * 9  # "That makes 12." + <|im_end|>
    assert second["reward"] == 1.0 and body["interactions"][0]["reward"] == 0.5


def test_detail_of_an_open_session_without_turns(api, recorded, make_session):
    empty = make_session(recorded.solver, [], status=S.OPEN, trajectory=T.PENDING)
    body = api.get(f"/api/v1/sessions/{empty.id}/").json()
    assert body["interactions"] == [] and body["reward"] is None and body["ended_at"] is None


def test_detail_of_another_projects_session_is_404(other_api, api, recorded, api_error):
    response = other_api.get(f"/api/v1/sessions/{recorded.multi.id}/")
    assert api_error(response, 404)["code"] == "not_found"
    body = response.content.decode()
    assert str(recorded.multi.id) not in body and "2 + 2" not in body
    assert api.get(f"/api/v1/sessions/{recorded.multi.id}/").status_code == 200


@pytest.mark.parametrize("bad", ["not-a-uuid", "123", str(uuid.uuid4())])
def test_detail_of_a_malformed_or_unknown_id_is_404(api, recorded, api_error, bad):
    api_error(api.get(f"/api/v1/sessions/{bad}/"), 404)


# --- trajectories.jsonl ---------------------------------------------------------------------


def test_export_streams_every_trajectory_equal_to_session_trajectories(api, recorded):
    r = recorded
    lines = export(api, r.run)
    # Oldest session first; the rewritten session is two sequences; the open one's single
    # turn is a trajectory too (status says it is pending).
    assert lines == expected_lines(r.multi, r.open, r.trained, r.unrewarded, r.rewritten)
    assert [line["session_id"] for line in lines] == [
        str(r.multi.id),
        str(r.open.id),
        str(r.trained.id),
        str(r.unrewarded.id),
        f"{r.rewritten.id}#0",
        f"{r.rewritten.id}#1",
    ]
    first = lines[0]
    assert first["agent_id"] == str(r.solver.id) and first["task_id"] == "arith-1"
    assert first["status"] == "ended" and first["trajectory"] == "ready"
    assert first["rewards"] == [0.5, 1.0]
    assert first["metadata"] == {
        "task_id": "arith-1",
        "interactions": [i.id for i in r.multi.interactions.order_by("turn")],
    }
    generated = [v for v, m in zip(first["versions"], first["loss_mask"], strict=True) if m]
    assert generated == [3] * 2 + [3] * 6 + [4] * 9


def test_export_lines_load_as_trajectories(api, recorded):
    for line in export(api, recorded.run):
        trajectory = Trajectory.from_dict({k: v for k, v in line.items() if k not in EXTRA_KEYS})
        assert trajectory.to_dict() == {k: v for k, v in line.items() if k not in EXTRA_KEYS}
        assert trajectory.num_generated > 0


@pytest.mark.parametrize(
    "status,expected",
    [
        ("ready", ["multi", "rewritten"]),
        ("trained", ["trained"]),
        ("unrewarded", ["unrewarded"]),
        ("pending", ["open"]),
        ("open", ["open"]),
        ("ended", ["multi", "trained", "unrewarded", "rewritten"]),
        ("dropped", []),
    ],
)
def test_export_filters_by_status(api, recorded, status, expected):
    lines = export(api, recorded.run, f"?status={status}")
    assert lines == expected_lines(*(getattr(recorded, name) for name in expected))


def test_export_of_a_run_without_sessions_is_empty(api, make_run, project):
    assert export(api, make_run(project, name="idle")) == []


def test_export_leaves_out_sessions_without_generated_tokens(api, recorded, make_session):
    make_session(recorded.solver, [], status=S.OPEN, trajectory=T.PENDING)
    assert len(export(api, recorded.run)) == 6


def test_export_names_a_file_to_save(api, recorded):
    response = api.get(f"/api/v1/runs/{recorded.run.id}/trajectories.jsonl")
    assert response["Content-Disposition"] == (
        f'attachment; filename="run-{recorded.run.id}-trajectories.jsonl"'
    )


def test_export_answers_jsonl_whatever_the_accept_header(api, recorded, api_error):
    lines = export(api, recorded.run, HTTP_ACCEPT="application/x-ndjson")
    assert len(lines) == 6
    assert len(export(api, recorded.run, HTTP_ACCEPT="text/csv")) == 6
    missing = api.get(
        f"/api/v1/runs/{uuid.uuid4()}/trajectories.jsonl", HTTP_ACCEPT="application/x-ndjson"
    )
    api_error(missing, 404)


def test_export_with_an_unknown_status_is_400(api, recorded, api_error):
    error = api_error(api.get(f"/api/v1/runs/{recorded.run.id}/trajectories.jsonl?status=x"), 400)
    assert "status" in error["fields"]


def test_export_of_another_projects_run_is_404(other_api, api, recorded, api_error):
    response = other_api.get(f"/api/v1/runs/{recorded.run.id}/trajectories.jsonl")
    assert api_error(response, 404)["code"] == "not_found"
    assert "2 + 2" not in response.content.decode()
    theirs = export(other_api, recorded.other_run)
    assert [line["session_id"] for line in theirs] == [str(recorded.secret.id)]
    assert export(api, recorded.run)  # the owner's key reaches the same URL


def test_export_reads_a_constant_number_of_queries(api, recorded, make_session):
    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            export(api, recorded.run)
        return len(queries)

    count()  # the key's first use of the day also records last_used_at
    before = count()
    for _ in range(5):
        make_session(
            recorded.solver,
            [{"messages": [{"role": "user", "content": "More?"}], "answer": "Yes.", "reward": 1}],
        )
    assert count() == before


def test_export_for_a_logged_in_member_naming_the_project(member_client, outsider_client, recorded):
    url = f"/api/v1/runs/{recorded.run.id}/trajectories.jsonl?project={recorded.run.project_id}"
    assert len(export(member_client, recorded.run, f"?project={recorded.run.project_id}")) == 6
    assert outsider_client.get(url).status_code == 404


def test_export_streams_in_batches_under_asgi(api_key, recorded):
    """Under ASGI a sync iterator would be read whole before the first byte; this one is not."""

    async def fetch():
        response = await AsyncClient().get(
            f"/api/v1/runs/{recorded.run.id}/trajectories.jsonl",
            headers={"Authorization": f"Bearer {api_key}"},
        )
        chunks = [chunk async for chunk in response.streaming_content]
        return response, chunks

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        response, chunks = async_to_sync(fetch)()
    assert response.status_code == 200
    assert response.is_async
    assert not [w for w in caught if "StreamingHttpResponse" in str(w.message)]
    lines = [json.loads(line) for line in b"".join(chunks).decode().splitlines()]
    r = recorded
    assert lines == expected_lines(r.multi, r.open, r.trained, r.unrewarded, r.rewritten)
