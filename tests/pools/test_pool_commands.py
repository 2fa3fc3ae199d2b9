"""./steep manage pool_create / pool_scale / pool_list."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from webapp.pools.models import Pool


def run(*args) -> str:
    from io import StringIO

    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_create_scale_and_list(db, project, make_run, set_status, model_named):
    assert "No inference pools" in run("pool_list")
    said = run("pool_create", "shared", "--model", "tiny-llama", "--no-start", "--replicas", "2")
    assert said.strip() == f"Pool shared: {model_named('tiny-llama')}, 2 replica(s), stopped."
    attached = make_run(project, base_model="tiny-llama", lora_rank=4, inference_pool="shared")
    make_run(project, name="draft", base_model="tiny-llama", lora_rank=4, inference_pool="shared")
    set_status(attached, "running")  # drafts are not counted: they hold nothing of the pool
    listed = run("pool_list").splitlines()
    assert listed[1].split() == ["shared", "stopped", "0/2", "1", model_named("tiny-llama")]
    scaled = run("pool_scale", "shared", "3")  # a stopped pool starts
    assert scaled.strip() == "Pool shared: 3 replica(s) wanted, starting."
    assert Pool.objects.get().replicas == 3


def test_bad_input_is_a_command_error_saying_why(db):
    with pytest.raises(CommandError, match="replicas"):
        run("pool_create", "shared", "--model", "m", "--replicas", "-3")
    with pytest.raises(CommandError, match="No inference pool is named 'ghost'"):
        run("pool_scale", "ghost", "1")
    with pytest.raises(CommandError, match="name"):
        run("pool_create", "Bad Name", "--model", "m")
