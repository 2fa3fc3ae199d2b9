"""Issue 17 item 4 on the real path: ``./steep up``'s demo on a Ray head too small for all of
it. The demo pool and one demo run take the head's CPUs; the other demo run waits ``queued``
saying for what, and starts by itself once the first one is stopped from the dashboard."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import dashboard_login, dashboard_post, demo_env, steep_up_stack
from tests.livestack import wait_for

# pool demo (1 torch engine) + the online demo run (1 trainer) + the dataset demo run (1
# trainer, 1 torch engine) need 4 CPUs; the head has 3.
HEAD_CPUS = 3
REASON = re.compile(
    rf"waiting for (1 CPU for the trainer|2 CPUs for the trainer and 1 inference server): "
    rf"(0|1) of {HEAD_CPUS} free; pool demo holds 1, run '(?P<holder>[^']+)' holds (1|2)"
)


@pytest.fixture
def small_steep_up(transactional_db, tmp_path_factory):
    """./steep up on a 3-CPU Ray head that a previous run's job already reported."""
    from webapp.runs.models import ClusterReport

    def reported() -> None:  # as the first job of an earlier start would have
        ClusterReport.objects.create(gpus=0, cpus=HEAD_CPUS)

    with steep_up_stack(
        tmp_path_factory,
        before_worker=reported,
        RAY_NUM_CPUS=str(HEAD_CPUS),
        RUN_RECONCILE_INTERVAL_S="2",
        STEEP_DEMO_AGENT="false",
    ) as started:
        yield started


@pytest.mark.slow
def test_a_demo_run_without_room_waits_queued_and_starts_when_the_other_is_stopped(
    small_steep_up,
):
    from webapp.runs.models import Run

    stack, data_dir, _ = small_steep_up
    project = Run.objects.get(pk=demo_env(data_dir)["STEEP_RUN"]).project

    def split():  # (the waiting run, the started one) once the launches are decided
        runs = list(Run.objects.filter(project=project))
        waiting = [r for r in runs if r.status == "queued" and r.queue_reason]
        started = [r for r in runs if r.status in ("starting", "running")]
        return (waiting[0], started[0]) if len(waiting) == len(started) == 1 else None

    waiting, holder = wait_for(split, 180, f"one demo run queued\n{stack.log_tail()}", interval=1)
    match = REASON.fullmatch(waiting.queue_reason)
    assert match and match["holder"] == holder.name, waiting.queue_reason
    wait_for(
        lambda: Run.objects.get(pk=holder.pk).status == "running",
        300,
        f"{holder.name} running\n{stack.log_tail()}",
        interval=1,
    )
    assert Run.objects.get(pk=waiting.pk).status == "queued"  # still no room

    browser = dashboard_login(demo_env(data_dir)["STEEP_URL"], data_dir)
    stop = dashboard_post(browser, f"/projects/{project.id}/runs/{holder.id}/stop/", {})
    assert stop.status_code == 302
    wait_for(
        lambda: Run.objects.get(pk=waiting.pk).status == "running",
        300,
        f"{waiting.name} started after the stop\n{stack.log_tail()}",
        interval=1,
    )
    waited = Run.objects.get(pk=waiting.pk)
    assert waited.queue_reason == "" and Run.objects.get(pk=holder.pk).status == "stopped"
    kinds = list(waited.events.values_list("kind", flat=True))
    assert kinds.index("queued") < kinds.index("status:starting"), kinds
