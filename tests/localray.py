"""A Ray head of a test's own, started in the test process (``ray.init``), for the tests that
drive Ray actors directly; nothing of it outlives the block.

Ray waits a fixed 30 s for its raylet to register with the GCS and then gives up ("The current
node timed out during startup"), which a loaded 2-core machine can exceed while other test
lanes run: the head is then stopped and started again, up to ``ATTEMPTS`` times.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Iterator

from workers.ray_cluster import _pids_naming

ATTEMPTS = 3
STARTUP_TIMEOUT = "timed out during startup"


@contextlib.contextmanager
def local_ray(prefix: str, num_cpus: int = 2) -> Iterator[str]:
    """Yields the head's temp dir (its processes' command lines name it)."""
    import ray

    saved = {k: os.environ.pop(k) for k in ("RAY_ADDRESS",) if k in os.environ}
    try:
        for attempt in range(1, ATTEMPTS + 1):
            temp_dir = tempfile.mkdtemp(prefix=prefix)
            try:
                ray.init(
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                    _temp_dir=temp_dir,
                )
                break
            except Exception as exc:
                _stop(temp_dir)
                if STARTUP_TIMEOUT not in str(exc) or attempt == ATTEMPTS:
                    raise
                logging.getLogger(__name__).warning("Ray start %d timed out; again", attempt)
        try:
            yield temp_dir
        finally:
            ray.shutdown()
            _wait_gone(temp_dir)
            assert not _pids_naming(temp_dir), "Ray processes were left behind"
    finally:
        os.environ.update(saved)


def _stop(temp_dir: str) -> None:
    """What a failed start left running: shut down, then its processes killed."""
    import ray

    ray.shutdown()
    for pid in _pids_naming(temp_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(temp_dir)


def _wait_gone(temp_dir: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _pids_naming(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
