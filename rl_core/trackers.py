"""A run mirrored to experiment trackers: Weights & Biases, MLflow and TensorBoard.

``TrackingReporter`` is a ``rl_core.loop.Reporter`` that hands everything to the run's own
reporter (the web app stays the record) and mirrors to each tracker the run's config as
parameters at the start, every step's metrics with its step number, each checkpoint (its path,
step and version; the files too with ``log_checkpoints``) and evaluation results.

Why a thread: a tracker's call may block (an MLflow server retrying, W&B starting its service),
and training must never wait for one. Reports are queued and one daemon thread makes every
tracker call, in order (the libraries expect one thread per run); the loop only enqueues.

Why failures are contained: a tracker is a mirror, not the record. One whose call raises (its
library missing, a store that cannot be written, a server refusing the key) is turned off for
the rest of the run, logged once, and reported once as a run event of kind ``tracker``
(``"<label>: ..."``), which the run page shows; the run goes on.

Every tracker library is imported inside its tracker's ``start``, on that thread: importing this
module (the job does) loads none of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any

from rl_core.tracker_specs import LABELS

logger = logging.getLogger(__name__)
EVENT_KIND = "tracker"
CLOSE_TIMEOUT_S = float(os.environ.get("STEEP_TRACKER_CLOSE_TIMEOUT_S", "120"))


class WandbTracker:
    """Weights & Biases: one W&B run per Steep run (its id, so a restarted job resumes it).

    Offline (no key, or ``mode: offline``) it writes under the run's directory, for ``wandb
    sync``; online it needs ``api_key`` (the run's, else ``STEEP_WANDB_API_KEY``). Steps a
    restarted job trains again are below W&B's last step and dropped by W&B: its history keeps
    the first attempt's values for them."""

    name = "wandb"

    def __init__(self, options: dict, run_id: str, run_name: str, directory: Path):
        self.options, self.run_id, self.run_name = options, run_id, run_name
        self.directory = directory / "wandb"
        self.run: Any = None

    def start(self, params: dict[str, Any]) -> None:
        import wandb

        self.directory.mkdir(parents=True, exist_ok=True)
        key = self.options.get("api_key", "")
        settings = wandb.Settings(
            silent=True,
            console="off",
            x_disable_stats=True,  # the trainer and servers run elsewhere (Ray actors)
            disable_git=True,
            save_code=False,
            **({"api_key": key} if key else {}),
            **({"base_url": self.options["base_url"]} if self.options.get("base_url") else {}),
        )
        self.run = wandb.init(
            project=self.options.get("project") or "steep",
            entity=self.options.get("entity") or None,
            name=self.run_name,
            id=self.run_id,
            resume="allow",
            dir=str(self.directory),
            mode=self.options.get("mode") or ("online" if key else "offline"),
            config=params,
            tags=self.options.get("tags") or None,
            settings=settings,
            reinit="create_new",
        )
        # Evaluations finish after their step was trained: their own x-axis.
        self.run.define_metric("eval/*", step_metric="eval/step")

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def checkpoint(self, step: int, version: int, path: str, size_bytes: int) -> None:
        import wandb

        meta = {"step": step, "version": version, "path": path, "size_bytes": size_bytes}
        artifact = wandb.Artifact(f"{self.run_id}-checkpoint", type="model", metadata=meta)
        if self.options.get("log_checkpoints"):
            artifact.add_dir(path)
        else:
            artifact.add_reference(Path(path).as_uri(), checksum=False)
        self.run.log_artifact(artifact, aliases=[f"step-{step}", "latest"])

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        self.run.log({f"eval/{k}": v for k, v in values.items()} | {"eval/step": step})

    def close(self, status: str) -> None:
        import wandb

        if self.run is not None:
            self.run.finish(exit_code=0 if status in ("completed", "stopped") else 1)
        wandb.teardown()  # its service process ends with it


class MlflowTracker:
    """MLflow: one MLflow run per Steep run (tagged ``steep.run_id``, found again on a restart)
    in ``experiment``, on ``tracking_uri`` (default: a file store under the run's directory)."""

    name = "mlflow"
    _INVALID = re.compile(r"[^\w\-./ :]")  # what MLflow refuses in a metric or param name

    def __init__(self, options: dict, run_id: str, run_name: str, directory: Path):
        self.options, self.run_id, self.run_name = options, run_id, run_name
        self.uri = options.get("tracking_uri") or (directory / "mlruns").as_uri()
        self.client: Any = None
        self.mlflow_run = ""

    def start(self, params: dict[str, Any]) -> None:
        if self.uri.startswith("file:") or "://" not in self.uri:
            # MLflow 3 refuses file stores unless told; they are what runs without a server get.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if token := self.options.get("tracking_token"):
            os.environ["MLFLOW_TRACKING_TOKEN"] = token  # the job runs one Steep run
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        name = self.options.get("experiment") or "steep"
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        runs = self.client.search_runs(
            [experiment], filter_string=f"tags.`steep.run_id` = '{self.run_id}'", max_results=1
        )
        if runs:  # a restarted job: the same MLflow run goes on
            self.mlflow_run = runs[0].info.run_id
            self.client.update_run(self.mlflow_run, status="RUNNING")
            return
        run = self.client.create_run(
            experiment, run_name=self.run_name, tags={"steep.run_id": self.run_id}
        )
        self.mlflow_run = run.info.run_id
        items = [Param(self._key(k), str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes 100 params a batch
            self.client.log_batch(self.mlflow_run, params=items[i : i + 100])

    def _key(self, name: str) -> str:
        return self._INVALID.sub("_", name)[:250]

    def metrics(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(self._key(prefix + k), v, now, step) for k, v in values.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.mlflow_run, metrics=items[i : i + 1000])

    def checkpoint(self, step: int, version: int, path: str, size_bytes: int) -> None:
        self.client.set_tag(self.mlflow_run, f"checkpoint.step_{step}", path)
        if self.options.get("log_checkpoints"):
            self.client.log_artifacts(self.mlflow_run, path, f"checkpoints/step_{step}")

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        self.metrics(step, values, prefix="eval/")

    def close(self, status: str) -> None:
        if self.mlflow_run:
            states = {"completed": "FINISHED", "stopped": "KILLED"}
            self.client.set_terminated(self.mlflow_run, states.get(status, "FAILED"))


class TensorBoardTracker:
    """TensorBoard: event files in the run's directory (``tensorboard --logdir`` on it).
    Scalars are TensorBoard's float32; the config is a text summary at step 0, each
    checkpoint's path a text summary at its step."""

    name = "tensorboard"

    def __init__(self, options: dict, run_id: str, run_name: str, directory: Path):
        self.log_dir = directory / "tensorboard"
        self.writer: Any = None

    def start(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        table = "\n".join(f"| {k} | {json.dumps(v)} |" for k, v in params.items())
        self.writer.add_text("config", "| setting | value |\n|---|---|\n" + table, 0)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def checkpoint(self, step: int, version: int, path: str, size_bytes: int) -> None:
        self.writer.add_text("checkpoints", f"version {version}: `{path}`", step)

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        self.metrics(step, {f"eval/{k}": v for k, v in values.items()})

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()


BACKENDS = {"wandb": WandbTracker, "mlflow": MlflowTracker, "tensorboard": TensorBoardTracker}


class _Failing:
    """A tracker the web app could not set up (``options["error"]``: a credential it cannot
    decrypt): it fails at start, as any tracker can."""

    def __init__(self, name: str, error: str):
        self.name, self.error = name, error

    def start(self, params: dict[str, Any]) -> None:
        raise RuntimeError(self.error)

    def close(self, status: str) -> None:
        pass


def make_trackers(specs: dict[str, dict], run_id: str, run_name: str, directory: Path) -> list:
    """The trackers of a run's resolved ``trackers`` (the web app's ``job_trackers``)."""
    return [
        _Failing(name, options["error"])
        if options.get("error")
        else BACKENDS[name](options, run_id, run_name, directory)
        for name, options in specs.items()
        if name in BACKENDS
    ]


class TrackingReporter:
    """``rl_core.loop.Reporter``: ``inner`` first, then the trackers, from a thread of their own.

    ``await start(params)`` before the first report; ``await close(status)`` at the end (waits
    up to ``CLOSE_TIMEOUT_S`` for what is queued)."""

    def __init__(self, inner: Any, trackers: list):
        self.inner = inner
        self.trackers = list(trackers)
        self.failed: dict[str, str] = {}  # tracker name → what the run page says
        self._queue: queue.Queue[tuple[str, tuple] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="steep-trackers", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reports: list[Any] = []  # the failures' events, sent from the thread
        self._closing = False

    async def start(self, params: dict[str, Any]) -> None:
        self._loop = asyncio.get_running_loop()
        if self.trackers:
            self._thread.start()
            self._queue.put(("start", (params,)))

    async def metrics(self, step: int, version: int, values: dict[str, float]) -> None:
        await self.inner.metrics(step, version, values)
        # What the web app stores (webapp.runs.jobs.job_report_metrics): finite numbers only.
        self._put("metrics", step, _finite(values))

    async def version(self, v: int) -> None:
        await self.inner.version(v)

    async def checkpoint(self, version: int, step: int, path: str, size_bytes: int) -> None:
        await self.inner.checkpoint(version, step, path, size_bytes)
        self._put("checkpoint", step, version, path, size_bytes)

    async def event(self, kind: str, message: str) -> None:
        await self.inner.event(kind, message)

    async def evaluation(self, step: int, values: dict[str, float]) -> None:
        """An evaluation of the checkpoint of ``step`` finished (its summary's numbers)."""
        self._put("evaluation", step, _finite(values))

    def _put(self, method: str, *args: Any) -> None:
        if self._thread.is_alive():
            self._queue.put((method, args))

    async def close(self, status: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish every tracker (``status``: the run's, completed / stopped / failed)."""
        if not self._thread.is_alive() or self._closing:
            return
        self._closing = True
        self._queue.put(("close", (status,)))
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            logger.warning("trackers still busy after %.0f s; the job ends without them", timeout_s)
        for report in self._reports:
            try:
                await asyncio.wrap_future(report)
            except Exception as exc:
                logger.warning("could not report a tracker's failure: %s", exc)

    async def flush(self) -> None:
        """Wait until the trackers have taken everything reported so far."""
        if self._thread.is_alive():
            await asyncio.to_thread(self._queue.join)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            method, args = item
            for tracker in self.trackers:
                if tracker.name in self.failed:
                    continue
                try:
                    getattr(tracker, method)(*args)
                except Exception as exc:
                    when = {"start": "at the start", "close": "at its end"}.get(method)
                    self._fail(tracker, method, exc, when or f"at step {args[0]}")
            self._queue.task_done()
        self._queue.task_done()

    def _fail(self, tracker: Any, method: str, exc: Exception, when: str) -> None:
        label = LABELS[tracker.name]
        message = (
            f"{label}: stopped mirroring this run {when} ({type(exc).__name__}: {exc})."
            " The run goes on without it."
        )[:2000]
        self.failed[tracker.name] = message
        logger.warning("%s", message, exc_info=exc)
        if method != "close":
            try:  # what it holds open (a W&B service, a file)
                tracker.close("failed")
            except Exception:
                pass
        if self._loop is not None and not self._loop.is_closed():
            self._reports.append(
                asyncio.run_coroutine_threadsafe(self.inner.event(EVENT_KIND, message), self._loop)
            )


def _finite(values: dict[str, float]) -> dict[str, float]:
    return {
        str(k)[:100]: float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
