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


def _raised_while_handling(first: BaseException, second: BaseException) -> BaseException:
    try:
        try:
            raise first
        except BaseException:
            raise second  # noqa: B904 - what Ray's own cleanup does: the first is its context
    except BaseException as exc:
        return exc


def test_the_ray_cluster_restarted_under_the_job_is_a_crash_found_anywhere_in_the_chain():
    """The local head died with the worker that started it; the job's driver outlived it and
    its next call reached the head started after it (seen in tests/chaos/test_worker_restart)."""
    lost = ray.exceptions.AuthenticationError("RPC error: WrongClusterID: GCS restarted")
    assert _process_died(lost)
    assert _process_died(_raised_while_handling(RuntimeError("train_step"), lost))
    died = ray.exceptions.ActorDiedError()
    assert _process_died(_raised_while_handling(died, RuntimeError("cleanup failed")))


def test_a_wrong_token_is_a_failure_not_a_crash():
    assert not _process_died(ray.exceptions.AuthenticationError("Invalid token"))
    assert not _process_died(_raised_while_handling(RuntimeError("a"), ValueError("b")))
