"""A multi-agent run attached to a pool shows each role's current adapter on the pool page."""

from __future__ import annotations

import pytest

from webapp.pools.selectors import pool_stats
from webapp.runs.models import Run

pytestmark = pytest.mark.django_db


def test_pool_stats_give_each_roles_current_adapter(make_pool, project, make_run, set_status):
    pool = make_pool(name="shared")
    run = make_run(project, lora_rank=8, roles=["speaker", "listener"], inference_pool="shared")
    set_status(run, "running")
    Run.objects.filter(pk=run.pk).update(weight_version=2)

    (row,) = pool_stats(pool=pool)["runs"]

    assert row["role_adapters"] == {
        "speaker": f"{run.id}-speaker-v2",
        "listener": f"{run.id}-listener-v2",
    }
    assert row["adapter"] == f"{run.id}-speaker-v2, {run.id}-listener-v2"


def test_a_one_policy_run_keeps_its_one_adapter(make_pool, project, make_run, set_status):
    pool = make_pool(name="shared")
    run = set_status(make_run(project, lora_rank=8, inference_pool="shared"), "running")
    Run.objects.filter(pk=run.pk).update(weight_version=2)
    (row,) = pool_stats(pool=pool)["runs"]
    assert (row["adapter"], row["role_adapters"]) == (f"{run.id}-v2", {})
