"""The session lifecycle (``webapp.gateway.lifecycle``): its table, its refusals, the run's
counters moving with every move, and no status write anywhere else."""

from __future__ import annotations

import ast
import itertools
import re
import uuid
from pathlib import Path

import pytest
from django.db import connection, transaction

from webapp.accounts.keys import SESSION_KEY_PREFIX, generate_key
from webapp.gateway import admission, episodes, lifecycle, services
from webapp.gateway.errors import GatewayError
from webapp.gateway.lane import in_transaction
from webapp.gateway.lifecycle import IllegalMove, State
from webapp.gateway.models import Interaction, Session
from webapp.runs import jobs
from webapp.runs.models import Run

ROOT = Path(__file__).resolve().parents[2]
S, T = Session.Status, Session.Trajectory

pytestmark = pytest.mark.django_db


# --- The table -----------------------------------------------------------------------------

LEGAL = {
    (State(S.OPEN, T.PENDING), State(S.ENDED, T.READY)),
    (State(S.OPEN, T.PENDING), State(S.ENDED, T.UNREWARDED)),
    (State(S.OPEN, T.PENDING), State(S.EXPIRED, T.READY)),
    (State(S.OPEN, T.PENDING), State(S.EXPIRED, T.UNREWARDED)),
    *(
        (State(status, a), State(status, b))
        for status in (S.ENDED, S.EXPIRED)
        for a, b in [
            (T.UNREWARDED, T.READY),
            (T.READY, T.CLAIMED),
            (T.CLAIMED, T.READY),
            (T.CLAIMED, T.TRAINED),
            (T.CLAIMED, T.DROPPED),
            (T.TRAINED, T.READY),
        ]
    ),
}


def test_the_table_allows_exactly_the_documented_moves():
    states = [State(s, t) for s, t in itertools.product(S.values, T.values)]
    allowed = {(a, b) for a in states for b in states if lifecycle.allowed(a, b)}
    assert allowed == LEGAL


def test_a_refused_move_says_what_is_allowed():
    error = IllegalMove("s1", State(S.ENDED, T.CLAIMED), State(S.EXPIRED, T.CLAIMED))
    assert error.status == 409 and error.code == "session_ended"
    assert "From ended a session can become: nothing (final)" in error.message
    assert "from claimed its trajectory can become: dropped, ready, trained" in error.message
    expired = IllegalMove("s1", State(S.EXPIRED, T.UNREWARDED), State(S.ENDED, T.READY))
    assert expired.status == 410 and expired.code == "session_expired"


# --- Moves on the database, counters in step ------------------------------------------------


@pytest.fixture
def run(project, make_run, set_status):
    run = make_run(project, max_staleness=1, batch_size=2)
    set_status(run, Run.Status.RUNNING)
    return run


@pytest.fixture
def agent(project, make_agent, run):
    return make_agent(project, run=run)


def counters(run) -> tuple[int, int]:
    run.refresh_from_db(fields=["sessions_open", "sessions_accepted"])
    return run.sessions_open, run.sessions_accepted


def recounted(run) -> tuple[int, int]:
    with connection.cursor() as cursor:
        admission.refresh(cursor, run.pk)
    return counters(run)


def start(agent, key: str) -> tuple[uuid.UUID, str]:
    """``/rl/start_session``'s database work: the session's id and key."""
    answer = in_transaction(
        episodes.start(
            token=key,
            agent_id=agent.pk,
            task_id="",
            metadata={},
            new_key=generate_key(SESSION_KEY_PREFIX),
        )
    )
    return uuid.UUID(answer["session_id"]), answer["api_key"]


def end(agent, session_key: str) -> State:
    """``/rl/end_session``'s database work: the state the session ended in."""
    answer = in_transaction(episodes.end(token=session_key, agent_id=agent.pk))
    return state(answer["session_id"])


def rewarded_turn(session_id, reward: float | None = 1.0) -> None:
    Interaction.objects.create(
        id=f"chatcmpl-{session_id.hex}",
        session_id=session_id,
        turn=0,
        request_hash="",
        messages=[],
        input_ids=[1, 2],
        outputs=[{"output_ids": [3], "logprobs": [-0.1], "versions": [0]}],
        response={},
        reward=reward,
    )


def state(session_id) -> State:
    session = Session.objects.get(pk=session_id)
    return State(session.status, session.trajectory)


def test_every_move_keeps_the_counters_equal_to_a_recount(run, agent, api_key):
    budget = (1 + 0 + 1) * 2  # (max_staleness + version + 1) * batch_size
    opened = [start(agent, api_key) for _ in range(budget)]
    ids = [session_id for session_id, _ in opened]
    assert counters(run) == (4, 0)
    with pytest.raises(GatewayError) as full:
        start(agent, api_key)
    assert full.value.status == 429 and counters(run) == (4, 0)

    for session_id in ids[:3]:
        rewarded_turn(session_id)
    assert [end(agent, key) for _, key in opened[:2]] == [State(S.ENDED, T.READY)] * 2
    assert counters(run) == (2, 2) == recounted(run)

    assert end(agent, opened[3][1]) == State(S.ENDED, T.UNREWARDED)
    assert counters(run) == (1, 2) == recounted(run)

    claimed = services.trajectories_claim(run=run, limit=10)
    assert {s.pk for s in claimed} == {ids[0], ids[1]}
    assert counters(run) == (1, 2) == recounted(run)

    assert jobs.job_release(run=run, session_ids=[str(ids[1])]) == 1
    assert state(ids[1]) == State(S.ENDED, T.READY)
    assert counters(run) == (1, 2) == recounted(run)

    jobs.job_mark_trained(run=run, version=1, trained=[str(ids[0])], dropped=[])
    services.trajectories_claim(run=run, limit=10)
    jobs.job_mark_trained(run=run, version=1, trained=[], dropped=[str(ids[1])])
    assert state(ids[0]) == State(S.ENDED, T.TRAINED)
    assert state(ids[1]) == State(S.ENDED, T.DROPPED)
    assert counters(run) == (1, 1) == recounted(run)

    episode_ids = jobs.job_submit_episodes(
        run=run,
        episodes=[
            {"input_ids": [1], "output_ids": [2], "logprobs": [-0.5], "versions": [0], "reward": 1}
        ],
    )
    assert state(episode_ids[0]) == State(S.ENDED, T.READY)
    assert counters(run) == (1, 2) == recounted(run)


def test_ending_twice_is_refused_and_changes_nothing(run, agent, api_key):
    _, key = start(agent, api_key)
    end(agent, key)
    before = counters(run)
    with pytest.raises(IllegalMove) as again:
        end(agent, key)
    assert again.value.status == 409 and "cannot become ended/unrewarded" in again.value.message
    assert counters(run) == before == recounted(run)


def test_an_expired_session_cannot_end(run, agent, api_key):
    session_id, key = start(agent, api_key)
    with transaction.atomic(), connection.cursor() as cursor:
        lifecycle.end(cursor, session_id, status=S.EXPIRED)
    with pytest.raises(IllegalMove) as late:
        end(agent, key)
    assert late.value.status == 410
    assert counters(run) == (0, 0) == recounted(run)


def test_expiry_trains_a_rewarded_session_only_when_the_run_says_so(
    project, make_run, set_status, make_agent, api_key
):
    for train_incomplete, expected in [(False, T.UNREWARDED), (True, T.READY)]:
        run = make_run(
            project, name=f"r{train_incomplete}", train_incomplete_sessions=train_incomplete
        )
        set_status(run, Run.Status.RUNNING)
        session_id, _ = start(make_agent(project, name=run.name, run=run), api_key)
        rewarded_turn(session_id)
        with transaction.atomic(), connection.cursor() as cursor:
            lifecycle.end(cursor, session_id, status=S.EXPIRED)
        assert state(session_id) == State(S.EXPIRED, expected)
        assert counters(run) == (0, int(expected == T.READY)) == recounted(run)


def test_a_failed_one_turn_completion_gives_back_only_a_slot_it_still_holds(run, agent, api_key):
    with connection.cursor() as cursor:
        assert lifecycle.admit(cursor, run_id=run.pk, config=run.config)
    assert counters(run) == (1, 0)
    with connection.cursor() as cursor:
        lifecycle.give_back(cursor, run_id=run.pk, session_id=uuid.uuid4())
    assert counters(run) == (0, 0) == recounted(run)
    # Recorded after all: the session holds its slot.
    session_id, _ = start(agent, api_key)
    with connection.cursor() as cursor:
        lifecycle.give_back(cursor, run_id=run.pk, session_id=session_id)
    assert counters(run) == (1, 0) == recounted(run)


# --- One home ---------------------------------------------------------------------------------

WRITE_CALLS = {
    "update",
    "create",
    "bulk_create",
    "update_or_create",
    "get_or_create",
    "bulk_update",
}
STATE_FIELDS = {"status", "trajectory"}
SET_CLAUSE = re.compile(r"\bUPDATE\b.*?\bSET\b(?P<sets>.*?)(\bWHERE\b|$)", re.S | re.I)


def _text(node: ast.AST) -> str | None:
    """A string constant, or an f-string with its holes as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _names(nodes) -> set[str]:
    return {node.id for node in nodes if isinstance(node, ast.Name)}


def state_writes(source: str, *, runs_may_set_status: bool = False) -> list[str]:
    """Places in ``source`` that write a session's status or trajectory, or insert a session."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in STATE_FIELDS:
                    if not (runs_may_set_status and target.attr == "status"):
                        found.append(f"{line}: assigns .{target.attr}")
        elif isinstance(node, ast.Call):
            found += [f"{line}: {what}" for what in _call_writes(node)]
        elif (text := _text(node)) is not None:
            for match in SET_CLAUSE.finditer(text):
                if re.search(r"\b(status|trajectory)\s*=", match.group("sets")):
                    found.append(f"{line}: SQL sets a status or trajectory")
    return found


def _call_writes(call: ast.Call) -> list[str]:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    keywords = {k.arg for k in call.keywords}
    writes = []
    if name.lstrip("_") == "insert" and "Session" in _names(call.args):
        writes.append("inserts a Session row")
    if name in WRITE_CALLS and keywords & STATE_FIELDS:
        writes.append(f"{name}() sets {sorted(keywords & STATE_FIELDS)}")
    if name in ("create", "bulk_create") and "Session" in _names(
        [getattr(func.value, "value", None)]
    ):
        writes.append(f"Session.objects.{name}()")
    for keyword in call.keywords:
        fields = {_text(e) for e in getattr(keyword.value, "elts", [])}
        if name == "save" and keyword.arg == "update_fields" and fields & STATE_FIELDS:
            writes.append(f"save() of {sorted(fields & STATE_FIELDS)}")
    return writes


def test_session_lifecycle_has_one_home():
    offenders = {}
    for path in sorted([*(ROOT / "webapp").rglob("*.py"), *(ROOT / "workers").rglob("*.py")]):
        relative = path.relative_to(ROOT).as_posix()
        if "migrations" in path.parts or relative == "webapp/gateway/lifecycle.py":
            continue
        # Runs have their own state machine (webapp/runs/services.py: run_transition).
        found = state_writes(
            path.read_text(), runs_may_set_status=relative == "webapp/runs/services.py"
        )
        if found:
            offenders[relative] = found
    assert offenders == {}


@pytest.mark.parametrize(
    "source",
    [
        "session.trajectory = 'ready'",
        "Session.objects.filter(pk=1).update(trajectory='claimed')",
        "s.save(update_fields=['status', 'ended_at'])",
        "Session.objects.create(project=p)",
        "sql.insert(cursor, Session, row)",
        "_insert(cursor, Session, row)",
        "cursor.execute(f'UPDATE {_SESSIONS} SET status = %s WHERE id = %s', [])",
        "Run.objects.update_or_create(pk=1, status='open')",
    ],
)
def test_the_scan_finds_a_state_write(source):
    assert state_writes(source)


def test_the_scan_leaves_reads_alone():
    reads = (
        "Session.objects.filter(status='open', trajectory='ready')\n"
        "cursor.execute(f'UPDATE {_RUN} SET n = (SELECT COUNT(*) FROM s WHERE status = %s) WHERE id = %s')\n"
        "session.status == 'open'\n"
    )
    assert state_writes(reads) == []
