"""A training run as a Ray job: ``python -m workers.ray_job --run-id ID --web-url URL``.

Submitted by the Celery worker through Ray's Jobs API; the job secret arrives in
``STEEP_JOB_SECRET``. It never imports Django: everything it knows and reports
goes through the web app's internal API (``workers.job_api``).

Phases: fetch config → check
that the cluster can hold the run (``workers.capacity``) → the trainer workers (Ray
actors, ``workers.trainer_group``) → start the inference replicas (Ray actors; a LoRA run
attached to a shared pool, ``inference_pool``, takes the pool's servers instead) →
trainer state (resuming from the run's last checkpoint, else starting from ``init_checkpoint``
when set: its weights are pushed to the replicas first) → the web app rewinds the run to the
restored step (``resume``: claims released, what was trained after the checkpoint ready again,
version and metrics back to the checkpoint's) → in dataset mode, the rollout
driver → the training loop until max_steps or a stop request → final checkpoint
and status → replicas and trainer workers down (a pool's servers stay; the run's
adapters are unloaded from them). The replicas are registered (the run
turns running) once the trainer's weights are on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import ray

from rl_core import tracing
from rl_core.config import RunConfig
from rl_core.distill import TeacherError
from rl_core.failpoints import ENV as FAILPOINTS
from rl_core.sources import SourceRules, config_source_errors, errors_text
from rl_core.tracker_specs import tracker_params
from rl_core.trackers import TrackingReporter, make_trackers
from workers.capacity import CapacityError, check_capacity, placement_timeout_s, resolve_backend
from workers.job_api import InternalAPI, WebEpisodeSink, WebReporter, WebSource, job_arguments
from workers.replicas import InferenceReplica, ray_options

logger = logging.getLogger("steep.job")
STOP_POLL_S = 2.0
SERVER_WATCH_S = 2.0  # how often the job checks that its inference servers still run
SERVER_START_TIMEOUT_S = float(os.environ.get("STEEP_SERVER_START_TIMEOUT", "600"))
SERVER_MAX_RESTART_FAILURES = 3
EVAL_POLL_S = 10.0  # how often a run with trackers asks for its finished evaluations


class SourcesRefused(RuntimeError):
    """The run's settings name what the instance's rules refuse (``rl_core.sources``)."""


def _process_died(exc: BaseException) -> bool:
    """A process under the job died, or the Ray cluster it ran on did: a crash, which a
    restart recovers from. Not an error in an actor's ``__init__`` (a restart would only repeat
    it: that one fails the run with its message).

    Ray wraps what it raises, so the whole chain is read. When the local Ray head dies with
    the worker that started it (the embedded default), the job's driver outlives it and its next
    call reaches the head started after it: ``AuthenticationError: WrongClusterID``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ray.exceptions.RayActorError) and not exc.actor_init_failed:
            return True
        if isinstance(exc, ray.exceptions.AuthenticationError) and "WrongClusterID" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


async def watch_servers(
    replicas: list, urls: list[str], backend: str, loop: Any, api: InternalAPI, reporter: Any
) -> None:
    """Restart an inference server that exited, until the job ends.

    Every ``SERVER_WATCH_S`` each replica is asked whether its server still runs. A dead one
    leaves the gateway's rotation (unregistered: agents fail over to the other servers, or get
    503 + Retry-After when it was the only one), is started again on its URL, takes the
    current policy (``TrainingLoop.resync_server``, between two steps) and is registered
    again. A server that cannot be restarted ``SERVER_MAX_RESTART_FAILURES`` times running
    ends the training loop (with its final checkpoint) and fails the run with the reason.
    """
    if not replicas:  # a run on a shared pool owns no server: the pool's job watches them
        await asyncio.Event().wait()
    failures = [0] * len(replicas)
    while True:
        await asyncio.sleep(SERVER_WATCH_S)
        for i, (replica, url) in enumerate(zip(replicas, urls, strict=True)):
            code = await replica.exit_code.remote()
            if code is None:
                continue
            await api.unregister_server(url)
            await reporter.event(
                "inference", f"Inference server {url} exited ({code}); restarting it."
            )
            try:
                await replica.restart.remote(SERVER_START_TIMEOUT_S)
                version = await loop.resync_server(url)
            except Exception as exc:
                failures[i] += 1
                logger.exception("restarting %s failed", url)
                if failures[i] >= SERVER_MAX_RESTART_FAILURES:
                    raise RuntimeError(
                        f"Inference server {url} could not be restarted ({failures[i]} tries): {exc}"
                    ) from exc
                continue
            failures[i] = 0
            await api.register_server(url, backend)
            await reporter.event(
                "inference", f"Inference server {url} restarted, serving version {version}."
            )


async def mirror_evals(api: InternalAPI, tracking: TrackingReporter, seen: set[str]) -> None:
    """Hand the trackers each evaluation of the run as it finishes, asking every
    ``EVAL_POLL_S`` until cancelled."""
    while True:
        try:
            await mirror_evals_once(api, tracking, seen)
        except Exception as exc:  # the mirror never fails the run; asked again next time
            logger.warning("could not fetch the run's evaluations for its trackers: %s", exc)
        await asyncio.sleep(EVAL_POLL_S)


async def mirror_evals_once(api: InternalAPI, tracking: TrackingReporter, seen: set[str]) -> None:
    for evaluation in sorted(await api.evals(), key=lambda e: e["step"]):
        if evaluation["id"] not in seen:
            seen.add(evaluation["id"])
            await tracking.evaluation(evaluation["step"], evaluation["values"])


def self_teacher(config, run_id: str, loop, weight_sync, backend: str, api: InternalAPI):
    """Self-distillation (``rl_core.hints``): the run's servers score each hinted session
    under the current version's weights (or adapter); what the hints did goes to the web app."""
    from rl_core.chat import load_chat_tokenizer
    from rl_core.distill import ServedModel, TeacherScorer
    from rl_core.hints import HintPlacement
    from rl_core.inference.adapters import current_adapter, role_prefix

    def adapter(role: str = "") -> str | None:
        # A multi-agent run: the current adapter of the role that produced the tokens.
        return current_adapter(
            role_prefix(run_id, role),
            loop.version,
            lora_rank=config.lora_rank,
            init_checkpoint=config.init_checkpoint,
        )

    return TeacherScorer(
        ServedModel(lambda: list(weight_sync.urls), backend, adapter),
        hints=HintPlacement(
            load_chat_tokenizer(config.base_model), config.hint_position, config.hint_template
        ),
        on_signals=api.hint_signals,
        topk=config.distill_topk,
        adapter_for=(lambda traj: adapter(traj.role)) if config.roles else None,
    )


async def run_job(run_id: str, web_url: str, secret: str) -> str:
    from rl_core.adapter_sync import AdapterSync, RoleAdapterSync
    from rl_core.chat import load_chat_tokenizer
    from rl_core.distill import connect_teacher
    from rl_core.evals import split_rows
    from rl_core.inference.adapters import AdapterSwitch, move_lag
    from rl_core.loop import TrainingLoop, WeightSync
    from rl_core.reward_specs import reward_is_deferred
    from rl_core.rewards import load_reward_fn
    from rl_core.rollout import RolloutDriver
    from rl_core.staleness import StalenessController
    from workers.trainer_group import TrainerGroup

    api = InternalAPI(web_url, run_id, secret)
    trainer = None
    teacher = None
    weight_sync: Any = None
    replicas: list = []
    keeper: asyncio.Task | None = None  # watch_servers: restarts a server that exited
    urls: list[str] = []
    tracking: TrackingReporter | None = None
    evals_task: asyncio.Task | None = None
    try:
        info = await api.config()
        config = RunConfig.from_dict(info["config"])
        # The instance's rules, before anything is read or imported: the web app's verdict
        # (it knows the project's checkpoints), and the job's own on what it was handed.
        rules = SourceRules.from_dict(info.get("sources") or {})
        if refused := info.get("source_errors") or config_source_errors(config, rules):
            raise SourcesRefused(errors_text(refused))
        data_dir = Path(info["data_dir"])
        data_dir.mkdir(parents=True, exist_ok=True)

        resources = ray.cluster_resources()
        await api.report_cluster(resources)
        backend = resolve_backend(config.inference_backend, resources)
        needs = check_capacity(config, backend, resources)  # refuse what can never be placed
        # Another tokenizer is refused; a teacher pool's servers are waited for.
        pool = await api.teacher_pool(placement_timeout_s()) if config.teacher_pool else None
        teacher = await connect_teacher(config, rules, pool, api.teacher_pool)
        env = {"STEEP_TORCH_THREADS": os.environ.get("STEEP_TORCH_THREADS", "1")}
        if os.environ.get(FAILPOINTS):  # chaos tests: the trainer kills itself where told
            env[FAILPOINTS] = os.environ[FAILPOINTS]
        # The trainer starts from config.init_checkpoint's weights when set, else base_model's.
        trainer = await asyncio.to_thread(
            TrainerGroup,
            config,
            bundle=needs.trainer_bundle,
            placement_timeout_s=placement_timeout_s(),
            env=env,
        )
        # On Steep's local Ray head: where the servers are recorded, so a stop of Steep finds them.
        pid_dir = os.environ.get("STEEP_PID_DIR", "")
        # A LoRA run's servers serve its adapters beside the base model (SGLang's LoRA flags).
        server_kwargs: dict[str, Any] = {"tensor_parallel": config.inference_tensor_parallel}
        if config.lora_rank:
            server_kwargs |= {
                "lora_rank": config.lora_rank,
                "lora_target_modules": config.lora_target_modules,
            }
        if config.inference_pool:
            # A shared pool's servers already run the base model: the run only adds its adapters.
            pooled = await api.pool_servers(placement_timeout_s())
            urls = [server["url"] for server in pooled]
            backend = pooled[0]["backend"]
        else:
            replicas = [
                InferenceReplica.options(**ray_options(needs.server_resources)).remote(
                    backend, config.base_model, env, pid_dir, server_kwargs
                )
                for _ in range(config.num_inference_servers)
            ]
            urls = [await replica.url.remote() for replica in replicas]

        # Dataset mode: the rollout driver admits rollouts here. Online mode: the web app
        # admits sessions and is told of stale drops through the source; a controller here
        # would count nothing as accepted and refuse the first drop.
        controller = (
            StalenessController(
                config.max_staleness,
                config.batch_size,
                config.max_concurrent_rollouts,
                config.max_queued_batches,
                version=trainer.version,
            )
            if config.mode == "dataset"
            else None
        )
        # Mirrors metrics, config and checkpoints to the run's experiment trackers, if any.
        reporter = tracking = TrackingReporter(
            WebReporter(api),
            make_trackers(info.get("trackers") or {}, run_id, info.get("name", run_id), data_dir),
        )
        await tracking.start(tracker_params(config.to_dict()))
        mirrored: set[str] = set()  # evaluations already handed to the trackers
        if tracking.trackers:
            evals_task = asyncio.create_task(mirror_evals(api, tracking, mirrored))
        source = WebSource(api)
        if controller is not None:  # judge/human episodes that are never rewarded give slots back
            source.on_unrewarded = controller.on_unrewarded
        # LoRA: each version is loaded as a new adapter, no pause (rl_core/adapter_sync.py).
        # On a shared pool the servers may change between steps: each push takes the pool's.
        refresh, on_change = api.pool_hooks(backend) if config.inference_pool else (None, None)
        # The rollout driver's answers in flight go on under each new adapter as it is loaded.
        switch = (
            AdapterSwitch(move_lag(config.max_staleness))
            if config.lora_rank and config.mode == "dataset"
            else None
        )
        # A server that died is left out of an update: watch_servers restarts and resyncs it.
        weight_sync = (
            RoleAdapterSync(
                urls,
                data_dir / "adapters",
                prefix=run_id,
                roles=config.roles,
                refresh=refresh,
                on_change=on_change,
                skip_unreachable=True,
                backend=backend,
            )
            if config.roles  # one adapter per role, each <run>-<role>-v<N>
            else AdapterSync(
                urls,
                data_dir / "adapters",
                prefix=run_id,
                refresh=refresh,
                on_change=on_change,
                skip_unreachable=True,
                switch=switch,
                backend=backend,
            )
            if config.lora_rank
            else WeightSync(
                urls,
                data_dir / "weights",
                strategy=config.weight_sync,
                skip_unreachable=True,
                backend=backend,
            )
        )
        loop = TrainingLoop(
            config,
            trainer,
            source,
            weight_sync,
            reporter,
            controller,
            checkpoint_dir=data_dir / "checkpoints",
            teacher=teacher,
        )
        if config.self_distill:  # the policy, with each session's hint, is the teacher
            teacher = loop.teacher = self_teacher(config, run_id, loop, weight_sync, backend, api)
        await loop.prepare()  # resume from the last checkpoint and push its weights before serving
        # Before anything is served: the run goes back to the restored step and version (0 without
        # a checkpoint). What the previous attempt claimed, or trained after that checkpoint, is
        # ready to train again; the web app's counters are the truth the controller resumes from.
        resumed = await api.resume(step=loop.step, version=loop.version)
        if controller is not None:
            controller.restore(
                version=loop.version, accepted=resumed["accepted"], dropped=resumed["dropped"]
            )
        if config.init_checkpoint and loop.step == 0:
            # The servers started from base_model; before serving, they take the weights the
            # trainer started from (another run's checkpoint), in base_model's dtype.
            await weight_sync.push(trainer)
            await reporter.event(
                "init", f"Started from the weights of checkpoint {config.init_checkpoint}."
            )
        for url in urls:
            await api.register_server(url, backend)

        driver_task = None
        if controller is not None:  # dataset mode
            # The held-out rows (eval_fraction) are never trained on: evaluations score them.
            rows, _ = split_rows(await api.dataset_rows(), config.eval_fraction, config.seed)
            driver = RolloutDriver(
                config,
                urls,
                load_chat_tokenizer(config.base_model),
                rows,
                # judge / human rewards: the web app scores the submitted episodes.
                None if reward_is_deferred(config.reward) else load_reward_fn(config.reward),
                controller,
                WebEpisodeSink(api),
                adapter_prefix=run_id if config.lora_rank else None,
                adapter_switch=switch,
                rows_used={int(k): v for k, v in resumed["rows_used"].items()},
                backend=backend,
            )
            driver_task = asyncio.create_task(driver.run())

        async def watch_for_stop() -> None:
            # A long-poll: the web app answers when the run is no longer running (a stop
            # request, or Steep interrupting it), or after a while with "running".
            while True:
                asked = time.monotonic()
                status = await api.watch_status("running")
                if status != "running":
                    break
                if time.monotonic() - asked < STOP_POLL_S:  # a web app that does not wait
                    await asyncio.sleep(STOP_POLL_S)
            if status == "stopping":
                await reporter.event("stop", "Stop requested: finishing the current step.")
            loop.stop()
            source.stop()

        watcher = asyncio.create_task(watch_for_stop())
        # The job restarts the servers it owns (a shared pool's job restarts the pool's).
        # A server that cannot be brought back ends the loop; its error fails the run below.
        keeper = asyncio.create_task(watch_servers(replicas, urls, backend, loop, api, reporter))
        keeper.add_done_callback(lambda task: task.cancelled() or loop.stop())
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, lambda: (loop.stop(), source.stop())
        )
        summary = await loop.run(config.max_steps)
        watcher.cancel()
        if keeper.done() and not keeper.cancelled() and keeper.exception() is not None:
            raise keeper.exception()  # type: ignore[misc]
        keeper.cancel()
        if driver_task is not None:
            driver.stop()
            driver_task.cancel()
        final = "stopped" if summary.stopped else "completed"
        if evals_task is not None:  # and the evaluations finished since it last asked
            evals_task.cancel()
            with contextlib.suppress(Exception):
                await mirror_evals_once(api, tracking, mirrored)
        await tracking.close(final)
        await api.status(
            final, message=f"Training {final} at step {summary.step} (version {summary.version})."
        )
        return final
    except Exception as exc:
        if _process_died(exc):
            # A trainer or server process died (SIGKILL, OOM, a lost node): a crash, not a
            # failure of the run. The job ends without a status, so the reconciler restarts the
            # run from its last checkpoint, as after a crash of this process (RUN_MAX_RESTARTS).
            logger.exception("run %s: a process of its job died", run_id)
            with contextlib.suppress(Exception):
                await WebReporter(api).event(
                    "crash",
                    "A trainer or inference process of the job, or its Ray cluster, died; "
                    "the run will restart.",
                )
            raise
        logger.exception("run %s failed", run_id)
        error = f"{type(exc).__name__}: {exc}"
        if not isinstance(
            exc, CapacityError | SourcesRefused | TeacherError
        ):  # these say all there is to say
            error += f"\n\n{traceback.format_exc()[-4000:]}"
        try:
            await api.release()
            await api.status("failed", error=error)
        except Exception:
            logger.exception("could not report the failure")
        raise
    finally:
        if keeper is not None:  # before the servers stop: a stopped one is not to be restarted
            keeper.cancel()
        if teacher is not None:
            await teacher.aclose()
        if weight_sync is not None:  # leave the broadcast group on both sides, close clients
            try:
                if isinstance(weight_sync, WeightSync):
                    await weight_sync.aclose(trainer)
                else:
                    if config.inference_pool:  # the pool outlives the run: take its adapters off
                        await weight_sync.unload_all()
                    await weight_sync.aclose()
            except Exception:
                logger.exception("could not close the weight sync")
        if isinstance(weight_sync, AdapterSync | RoleAdapterSync):  # a pool's servers may change
            urls = weight_sync.urls
        for url in urls:
            try:
                await api.unregister_server(url)
            except Exception:
                pass
        for replica in replicas:
            try:
                await replica.stop.remote()
            except Exception:
                pass
        if trainer is not None:
            await asyncio.to_thread(trainer.close)
        if evals_task is not None:
            evals_task.cancel()
        if tracking is not None:  # a no-op after a clean end
            await tracking.close("failed")
        await api.aclose()


def main(argv: list[str] | None = None) -> None:
    run_id, web_url, secret = job_arguments(
        "Run one Steep training run (a Ray job).", "--run-id", argv
    )
    # A trace per training step when the OTEL_* the web app passed on ask for it.
    tracing.setup("steep-trainer", {"steep.run_id": run_id})
    asyncio.run(run_job(run_id, web_url, secret))


if __name__ == "__main__":
    main()
