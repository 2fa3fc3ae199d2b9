"""A run's job tells a crash (a process of it died: the run restarts) from a failure (an
error, including one in an actor's ``__init__``, which a restart would only repeat)."""

from __future__ import annotations

import ray.exceptions

from workers.ray_job import _process_died


def test_an_actor_whose_process_died_is_a_crash():
    assert _process_died(ray.exceptions.ActorDiedError())
    assert _process_died(ray.exceptions.RayActorError(None, "worker process died"))


def test_an_actor_that_failed_in_its_init_or_any_other_error_is_a_failure():
    assert not _process_died(ray.exceptions.RayActorError(None, "ImportError", True))
    assert not _process_died(RuntimeError("a bug"))
    assert not _process_died(TimeoutError())
