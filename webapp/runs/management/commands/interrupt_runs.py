import os
import signal
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from webapp.pools.launching import pools_interrupt
from webapp.runs.launching import runs_interrupt
from workers.ray_cluster import stop_local_cluster


class Command(BaseCommand):
    requires_system_checks: list[str] = []  # it runs while Ctrl-C waits: start fast
    help = (
        "Steep is stopping: mark active runs interrupted (they resume, without using their "
        "RUN_MAX_RESTARTS, when a worker starts again) and stop their jobs. ./steep up runs it on Ctrl-C."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--stop-local-ray",
            action="store_true",
            help="Then stop the local Ray head of DATA_DIR and the runs' inference servers "
            "(by PID; nothing else is touched). Ignored with RAY_ADDRESS.",
        )
        parser.add_argument(
            "--when-signalled",
            action="store_true",
            help="Load everything, then wait for SIGUSR1 and only then act (./steep up starts "
            "it beside the server, so that Ctrl-C does not wait on Python and Django starting "
            "under load). Exits without acting when its parent is gone.",
        )

    def handle(self, *args, stop_local_ray=False, when_signalled=False, **options):
        if when_signalled and not _signalled():
            return
        external = bool(settings.RAY_ADDRESS)
        interrupted = runs_interrupt(stop_jobs=external)
        if interrupted:
            self.stdout.write(
                f"{len(interrupted)} run(s) interrupted; they resume when Steep starts again."
            )
        pools = pools_interrupt(stop_jobs=external)
        if pools:
            self.stdout.write(
                f"{len(pools)} inference pool(s) interrupted; they start again with Steep."
            )
        if stop_local_ray and not external:
            stop_local_cluster(data_dir=Path(settings.DATA_DIR))


def _signalled() -> bool:
    """Wait for SIGUSR1 (True) or for the parent to be gone (False). The sender repeats the
    signal until this process exits, so one sent while it was still starting (ignored then,
    as ./steep up starts it) is not lost."""
    parent = os.getppid()
    signal.signal(signal.SIGUSR1, lambda *_: None)  # a blocked signal with a handler queues
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    while os.getppid() == parent:
        if signal.sigtimedwait({signal.SIGUSR1}, 1.0) is not None:
            return True
    return False
