"""The gateway's database lane: group commit, one failure never undoes the others, answers
only after the commit.

Operations here write ``Project`` rows with raw SQL (a table with no foreign keys and a
unique name); each test drives a fresh ``Lane`` from ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from django.db import connection
from django.utils import timezone

from webapp.accounts.models import Project
from webapp.agents.models import Agent
from webapp.gateway import lane as lanes
from webapp.gateway.errors import GatewayError
from webapp.gateway.lane import Lane, LaneError, in_thread

pytestmark = pytest.mark.django_db(transaction=True)

_PROJECTS = Project._meta.db_table


@pytest.fixture
def lane():
    lane = Lane(name="test-lane")
    yield lane
    # The lane's thread keeps its connection open; close it so the test database can be dropped.
    db = asyncio.run(lane.run(lambda cursor: cursor.db))
    db.inc_thread_sharing()
    try:
        db.close()
    finally:
        db.dec_thread_sharing()


def insert(name: str, project_id: uuid.UUID | None = None):
    """An operation that inserts project ``name`` and returns it."""
    project_id = project_id or uuid.uuid4()

    def operation(cursor) -> str:
        cursor.execute(
            f"INSERT INTO {_PROJECTS} (id, name, created_at) VALUES (%s, %s, %s)",
            [
                Project._meta.pk.get_db_prep_value(project_id, cursor.db),
                name,
                Project._meta.get_field("created_at").get_db_prep_save(timezone.now(), cursor.db),
            ],
        )
        return name

    return operation


def failing(exc: Exception, *, after_writing: str | None = None):
    """An operation that raises ``exc`` (after inserting project ``after_writing``, if given)."""

    def operation(cursor):
        if after_writing is not None:
            insert(after_writing)(cursor)
        raise exc

    return operation


def names() -> set[str]:
    return set(Project.objects.values_list("name", flat=True))


class Gate:
    """An operation that holds the lane until released, so that what is queued meanwhile
    goes into the next batch together."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self, cursor) -> None:
        self.entered.set()
        assert self.released.wait(timeout=30), "the gate was never released"

    async def hold(self, lane: Lane) -> asyncio.Task:
        task = asyncio.create_task(lane.run(self))
        assert await asyncio.to_thread(self.entered.wait, 30)
        return task


async def _in_one_batch(lane: Lane, operations: list) -> list:
    """Run ``operations`` in one batch (after a gate); their results or exceptions, in order."""
    gate = Gate()
    held = await gate.hold(lane)
    tasks = [asyncio.create_task(lane.run(op)) for op in operations]
    await asyncio.sleep(0)  # every task queues its operation before the gate opens
    gate.released.set()
    await held
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_concurrent_operations_commit_in_fewer_batches_than_operations(lane):
    async def main() -> list[str]:
        return await asyncio.gather(*(lane.run(insert(f"p{i}")) for i in range(200)))

    results = asyncio.run(main())

    assert results == [f"p{i}" for i in range(200)]
    assert lane.operations == 200
    assert 1 <= lane.batches < 200
    assert names() == {f"p{i}" for i in range(200)}


def test_everything_queued_while_a_batch_runs_commits_in_the_next_batch_of_at_most_max_batch(
    lane,
):
    count = lanes.MAX_BATCH + 44
    results = asyncio.run(_in_one_batch(lane, [insert(f"p{i}") for i in range(count)]))

    assert results == [f"p{i}" for i in range(count)]
    # The gate's batch, then MAX_BATCH operations, then the rest.
    assert (lane.batches, lane.operations) == (3, count + 1)
    assert len(names()) == count


def test_a_gateway_error_fails_only_its_own_operation(lane):
    refused = GatewayError(429, "Slow down.", code="rate_limit_exceeded")
    results = asyncio.run(_in_one_batch(lane, [insert("a"), failing(refused), insert("c")]))

    assert results == ["a", refused, "c"]
    assert names() == {"a", "c"}
    assert (lane.batches, lane.operations) == (2, 4)  # no retry was needed


@pytest.mark.parametrize("late", [False, True], ids=["first", "last"])
def test_an_unexpected_error_after_a_write_undoes_only_that_operations_write(lane, late):
    boom = RuntimeError("bug in an operation")
    operations = [insert("a"), insert("b"), failing(boom, after_writing="doomed")]
    if not late:
        operations.reverse()
    results = asyncio.run(_in_one_batch(lane, operations))

    assert sorted(map(str, results)) == sorted(["a", "b", str(boom)])
    assert boom in results
    assert names() == {"a", "b"}


def test_a_duplicate_key_fails_only_its_own_operation(lane):
    taken = uuid.uuid4()
    asyncio.run(lane.run(insert("first", taken)))

    results = asyncio.run(
        _in_one_batch(lane, [insert("a"), insert("duplicate", taken), insert("c")])
    )

    assert results[0] == "a" and results[2] == "c"
    assert isinstance(results[1], LaneError), results[1]  # a database error, as a 503
    assert names() == {"first", "a", "c"}


def test_an_answer_comes_only_after_its_batch_has_committed(lane):
    """The first operation's caller resumes while the second still runs if answers came
    before the commit; it must find its row committed, seen from another connection."""
    finishing = threading.Event()

    def slow(cursor) -> str:
        finishing.wait(timeout=0.5)
        return "slow"

    def committed(name: str) -> bool:
        try:
            return Project.objects.filter(name=name).exists()
        finally:
            connection.close()  # this worker thread's own connection

    async def main() -> bool:
        gate = Gate()
        held = await gate.hold(lane)
        first = asyncio.create_task(lane.run(insert("a")))
        second = asyncio.create_task(lane.run(slow))
        await asyncio.sleep(0)
        gate.released.set()
        await held
        assert await first == "a"
        visible = await asyncio.to_thread(committed, "a")
        finishing.set()
        assert await second == "slow"
        return visible

    assert asyncio.run(main())


def test_a_batch_whose_commit_fails_keeps_nothing_and_the_lane_goes_on(lane, caplog):
    # A dangling foreign key: Django's constraints are deferred, so the COMMIT fails (the
    # batch is retried alone, and fails again).
    results = asyncio.run(_in_one_batch(lane, [_agent_of_missing_project()]))
    _forget_logged_exceptions(caplog)

    assert isinstance(results[0], LaneError), results
    assert not Agent.objects.exists()
    assert asyncio.run(lane.run(insert("after"))) == "after"
    assert names() == {"after"}


def test_a_deferred_constraint_violation_does_not_fail_the_rest_of_its_batch(lane, caplog):
    results = asyncio.run(_in_one_batch(lane, [insert("a"), _agent_of_missing_project()]))
    _forget_logged_exceptions(caplog)

    assert results[0] == "a"
    assert names() == {"a"}


@pytest.mark.skipif(connection.vendor != "sqlite", reason="PostgreSQL ends a failed COMMIT itself")
def test_a_failed_commit_releases_the_database_even_while_its_error_is_kept(lane, caplog):
    asyncio.run(_in_one_batch(lane, [_agent_of_missing_project()]))
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout = 200")
    try:
        Project.objects.create(name="writer")  # another connection must be able to write
    finally:
        _forget_logged_exceptions(caplog)
        connection.close()  # back to the default busy timeout


def _forget_logged_exceptions(caplog) -> None:
    """Drop the tracebacks pytest keeps with logged errors (they hold the lane's cursors)."""
    for record in caplog.records:
        record.exc_info = None


def _agent_of_missing_project():
    """An operation that inserts an agent of a project that does not exist."""

    def operation(cursor) -> None:
        cursor.execute(
            f"INSERT INTO {Agent._meta.db_table} (id, project_id, run_id, name, created_at)"
            " VALUES (%s, %s, NULL, %s, %s)",
            [
                Agent._meta.pk.get_db_prep_value(uuid.uuid4(), cursor.db),
                Project._meta.pk.get_db_prep_value(uuid.uuid4(), cursor.db),
                "orphan",
                Agent._meta.get_field("created_at").get_db_prep_save(timezone.now(), cursor.db),
            ],
        )

    return operation


def test_operations_that_need_not_be_durable_are_committed_too(lane):
    async def main() -> list[str]:
        return await asyncio.gather(
            lane.run(insert("lazy"), durable=False),
            lane.run(insert("durable")),
            lane.run(insert("lazy-too"), durable=False),
        )

    assert asyncio.run(main()) == ["lazy", "durable", "lazy-too"]
    assert names() == {"lazy", "durable", "lazy-too"}


def test_in_thread_commits_an_operation_or_rolls_all_of_it_back():
    assert asyncio.run(in_thread(insert("kept"))) == "kept"
    with pytest.raises(RuntimeError):
        asyncio.run(in_thread(failing(RuntimeError("bug"), after_writing="undone")))
    with pytest.raises(GatewayError):
        asyncio.run(in_thread(failing(GatewayError(400, "no"), after_writing="undone-too")))
    assert names() == {"kept"}


@pytest.mark.parametrize("threshold", ["default", None], ids=["default", "prepare-threshold-none"])
def test_on_postgresql_the_lanes_repeated_statements_are_prepared_once(lane, threshold):
    """PostgreSQL parses and plans a statement the lane runs for every request once per
    connection (a server-binding cursor; Django's own writes parameters into the text),
    unless DATABASE_URL says ``prepare_threshold=none`` (PgBouncer in transaction mode)."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite compiles its statements in-process")
    select = f"SELECT count(*) FROM {_PROJECTS} WHERE name = %s"

    def count(cursor) -> int:
        cursor.execute(select, ["no such project"])
        return cursor.fetchone()[0]

    def prepared(cursor) -> list[str]:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]

    def use_options(options: dict):
        def operation(cursor):
            cursor.db.settings_dict["OPTIONS"] = options

        return operation

    options = dict(connection.settings_dict["OPTIONS"])
    if threshold is None:  # as database_from_url reads ?prepare_threshold=none
        asyncio.run(lane.run(use_options({**options, "prepare_threshold": None})))
        db = asyncio.run(lane.run(lambda cursor: cursor.db))
        db.inc_thread_sharing()
        db.close()  # the lane connects again, with the option
        db.dec_thread_sharing()
    try:
        for _ in range(8):  # psycopg prepares a statement at its fifth run on a connection
            assert asyncio.run(lane.run(count)) == 0
        found = asyncio.run(lane.run(prepared))
    finally:
        asyncio.run(lane.run(use_options(options)))
    ours = [text for text in found if f"FROM {_PROJECTS} WHERE name = $1" in text]
    assert len(ours) == (0 if threshold is None else 1), found
