"""The internal API a run's Ray job talks to: ``/internal/v1/runs/<run_id>/...``.

Authenticated with the run's per-attempt job secret (``Authorization: Bearer
steep-job-...``); project keys are never accepted here. Views parse, call one
service from ``webapp.runs.jobs``, and answer JSON. Each view checks its input and
answers 400 with what is wrong; past that, an error is a bug and answers 500.

Two views long-poll, so that an idle run asks a few times a minute instead of twice a
second: ``claim`` (with ``wait_s``) answers as soon as it has claimed trajectories, and
``watch`` as soon as the run's status is not ``?while=``; either answers anyway after
``wait_s`` seconds, at most ``INTERNAL_API_LONG_POLL_S``. They are async views that check
every ``LONG_POLL_CHECK_S`` (``_long_poll``): short reads, no transaction held between them,
and no shared thread either (behind sync-only middleware, such as WhiteNoise, Django gives
each request a thread of its own, which the wait holds idle); a client that goes away
cancels the wait.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import time
import uuid
from collections.abc import Callable
from functools import lru_cache
from typing import TypeVar

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from rl_core.reward_specs import reward_is_deferred
from webapp.accounts.auth import bearer_token
from webapp.runs import jobs
from webapp.runs.models import Run
from webapp.runs.services import IllegalTransition
from webapp.runs.sources import run_sourced, source_rules
from webapp.runs.trackers import job_trackers


class BadRequest(Exception):
    pass


def _error(status: int, message: str) -> JsonResponse:
    return JsonResponse(
        {"error": {"message": message, "code": "internal_api_error", "fields": {}}}, status=status
    )


def _body(request: HttpRequest) -> dict:
    try:
        data = json.loads(request.body or b"{}")
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data


def _int(data: dict, name: str, default: int | None = None) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer")
    return value


def _str(data: dict, name: str, default: str = "") -> str:
    value = data.get(name, default)
    if not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string")
    return value


def _session_ids(data: dict, name: str) -> list[str]:
    value = data.get(name, [])
    if not isinstance(value, list) or not all(_is_uuid(v) for v in value):
        raise BadRequest(f"'{name}' must be a list of session ids")
    return value


def _is_uuid(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int_list(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


EPISODE_OPTIONAL = {
    "finish_reason": str,
    "text": str,
    "task_id": str,
    "group_id": str,
    "messages": list,
    "metadata": dict,
    "sampling": dict,
}


def _episode(index: int, episode, *, deferred: bool = False) -> dict:
    """An episode as ``rl_core.rollout.Episode.to_dict`` writes it, or BadRequest saying what is
    wrong. ``deferred``: the run's reward is a judge's or a person's, so ``reward`` is null."""
    where = f"episodes[{index}]"
    if not isinstance(episode, dict):
        raise BadRequest(f"'{where}' must be an object")
    for name in ("input_ids", "output_ids", "versions"):
        if not _is_int_list(episode.get(name)):
            raise BadRequest(f"'{where}.{name}' must be a list of integers")
    logprobs = episode.get("logprobs")
    if not isinstance(logprobs, list) or not all(_is_number(v) for v in logprobs):
        raise BadRequest(f"'{where}.logprobs' must be a list of numbers")
    if not len(episode["output_ids"]) == len(logprobs) == len(episode["versions"]):
        raise BadRequest(
            f"'{where}': output_ids, logprobs and versions need one entry per generated token"
        )
    if deferred:
        if episode.get("reward") is not None:
            raise BadRequest(f"'{where}.reward' must be null: this run's reward is given later")
    elif not _is_number(episode.get("reward")) or not math.isfinite(episode["reward"]):
        raise BadRequest(f"'{where}.reward' must be a finite number")
    if "latency_ms" in episode and not _is_number(episode["latency_ms"]):
        raise BadRequest(f"'{where}.latency_ms' must be a number")
    for name, kind in EPISODE_OPTIONAL.items():
        if episode.get(name) is not None and not isinstance(episode[name], kind):
            raise BadRequest(f"'{where}.{name}' must be a {kind.__name__}")
    sampling = episode.get("sampling") or {}
    for name in ("temperature", "top_p", "top_k"):  # stored as the turn's own columns
        if sampling.get(name) is not None and not _is_number(sampling[name]):
            raise BadRequest(f"'{where}.sampling.{name}' must be a number")
    return episode


@lru_cache(maxsize=8)
def _networks(cidrs: tuple[str, ...]) -> tuple:
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def network_allowed(address: str) -> bool:
    """``INTERNAL_API_ALLOWED_CIDRS`` (empty: any network) holds ``address``: the rule of
    ``/internal/``, and of ``/metrics`` (``webapp.metrics``)."""
    if not settings.INTERNAL_API_ALLOWED_CIDRS:
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    networks = _networks(tuple(settings.INTERNAL_API_ALLOWED_CIDRS))
    return any(ip in network for network in networks)


def _network_allowed(request: HttpRequest) -> bool:
    return network_allowed(request.META.get("REMOTE_ADDR", ""))


def _admit(request: HttpRequest, run_id: str, method: str) -> Run | JsonResponse:
    """The run whose job secret the request carries, or the error response."""
    if not _network_allowed(request):
        return _error(403, "the internal API is not reachable from this network")
    if request.method != method:
        return _error(405, f"use {method}")
    run = jobs.job_authenticate(
        run_id=run_id, token=bearer_token(request.headers.get("Authorization", ""))
    )
    if run is None:
        return _error(401, "invalid job secret for this run")
    return run


def internal(method: str):
    """A view of the internal API (sync, or async for the long-polls): ``view(request, run)``."""

    def wrap(view: Callable):
        if iscoroutinefunction(view):

            async def handler(request: HttpRequest, run_id: str):
                run = await sync_to_async(_admit)(request, run_id, method)
                if isinstance(run, JsonResponse):
                    return run
                try:
                    return await view(request, run)
                except BadRequest as exc:
                    return _error(400, str(exc))

        else:

            def handler(request: HttpRequest, run_id: str):
                run = _admit(request, run_id, method)
                if isinstance(run, JsonResponse):
                    return run
                try:
                    return view(request, run)
                except BadRequest as exc:
                    return _error(400, str(exc))
                except IllegalTransition as exc:
                    return _error(409, str(exc))

        return csrf_exempt(handler)

    return wrap


T = TypeVar("T")
LONG_POLL_CHECK_S = 0.5  # between two checks of a long-poll


def _wait_s(value) -> float:
    """A requested long-poll wait (seconds, default none), capped at INTERNAL_API_LONG_POLL_S."""
    try:
        wait = float(value)
    except (TypeError, ValueError):
        raise BadRequest("'wait_s' must be a number of seconds") from None
    if isinstance(value, bool) or not math.isfinite(wait) or wait < 0:
        raise BadRequest("'wait_s' must be a number of seconds, 0 or more")
    return min(wait, settings.INTERNAL_API_LONG_POLL_S)


async def _long_poll(check: Callable[[], T], wait_s: float) -> T:
    """``check()`` (ORM work, run in Django's thread) until it returns something truthy or
    ``wait_s`` has passed; its last result. Nothing is held between two checks."""
    deadline = time.monotonic() + wait_s
    while True:
        result = await sync_to_async(check)()
        remaining = deadline - time.monotonic()
        if result or remaining <= 0:
            return result
        await asyncio.sleep(min(LONG_POLL_CHECK_S, remaining))


@internal("GET")
def config(request, run: Run):
    checkpoint = run.checkpoints.order_by("-version").first()
    # init_checkpoint as its directory; what the instance's rules refuse, for the job to fail
    # with before it reads or imports anything; the rules, for the job to check them itself.
    settings_, refused = run_sourced(run=run)
    return JsonResponse(
        {
            "run_id": str(run.id),
            "name": run.name,
            "status": run.status,
            "config": settings_,
            "source_errors": refused,
            "trackers": job_trackers(run),  # credentials decrypted: for the job alone
            "sources": source_rules(unrestricted=run.sources_unrestricted).to_dict(),
            "step": run.step,
            "weight_version": run.weight_version,
            "attempt": run.job_attempt,
            "data_dir": str(settings.DATA_DIR / "runs" / str(run.id)),
            "dataset": None
            if run.dataset_id is None
            else {"id": str(run.dataset_id), "rows": run.dataset.row_count},
            "latest_checkpoint": None
            if checkpoint is None
            else {"version": checkpoint.version, "step": checkpoint.step, "path": checkpoint.path},
        }
    )


async def _file_chunks(path: str, size: int = 1 << 20):
    # An async iterator: under ASGI, Django streams a sync one through a thread, with a warning.
    with open(path, "rb") as file:
        while chunk := await asyncio.to_thread(file.read, size):
            yield chunk


@internal("GET")
def dataset(request, run: Run):
    if run.dataset is None:
        return _error(404, "this run has no dataset")
    response = StreamingHttpResponse(
        _file_chunks(run.dataset.path), content_type="application/x-ndjson"
    )
    response["Content-Length"] = str(os.path.getsize(run.dataset.path))
    return response


@internal("POST")
def status(request, run: Run):
    data = _body(request)
    target = data.get("status")
    if target not in {
        Run.Status.RUNNING,
        Run.Status.COMPLETED,
        Run.Status.FAILED,
        Run.Status.STOPPED,
    }:
        raise BadRequest("'status' must be running, completed, failed or stopped")
    error = data.get("error")
    if error is not None and not isinstance(error, str):
        raise BadRequest("'error' must be a string or null")
    run = jobs.job_report_status(run=run, status=target, message=_str(data, "message"), error=error)
    return JsonResponse({"status": run.status})


@internal("POST")
def servers(request, run: Run):
    data = _body(request)
    url = data.get("url")
    if not isinstance(url, str) or not url.startswith("http"):
        raise BadRequest("'url' must be an http(s) URL")
    action = data.get("action", "register")
    if action not in ("register", "unregister"):
        raise BadRequest("'action' must be register or unregister")
    if action == "unregister":
        jobs.job_unregister_server(run=run, url=url)
    else:
        jobs.job_register_server(run=run, url=url, backend=_str(data, "backend", "torch"))
    return JsonResponse({"ok": True})


@internal("GET")
def pool(request, run: Run):
    """The shared pool the run attaches to: its status and servers (404 for a run with none)."""
    return _pool(run.config.get("inference_pool") or "", "attached to an inference pool")


@internal("GET")
def teacher_pool(request, run: Run):
    """The shared pool whose base model teaches the run (``teacher_pool``), with its model."""
    return _pool(run.config.get("teacher_pool") or "", "taught by an inference pool")


def _pool(name: str, what: str) -> JsonResponse:
    from webapp.pools.models import PoolServer
    from webapp.pools.selectors import pool_get

    found = pool_get(name=name) if name else None
    if found is None:
        return _error(404, f"this run is not {what}")
    return JsonResponse(
        {
            "name": found.name,
            "status": found.status,
            "base_model": found.base_model,
            "servers": list(PoolServer.objects.filter(pool=found).values("url", "backend")),
        }
    )


@internal("POST")
def cluster(request, run: Run):
    data = _body(request)
    for name in ("gpus", "cpus"):
        if not _is_number(data.get(name)) or not 0 <= data[name] < math.inf:
            raise BadRequest(f"'{name}' must be a number of at least 0")
    jobs.job_report_cluster(run=run, gpus=float(data["gpus"]), cpus=float(data["cpus"]))
    return JsonResponse({"ok": True})


@internal("POST")
def metrics(request, run: Run):
    data = _body(request)
    values = data.get("metrics")
    if not isinstance(values, dict):
        raise BadRequest("'metrics' must be an object of name → number")
    stored = jobs.job_report_metrics(
        run=run,
        step=_int(data, "step"),
        version=_int(data, "version", run.weight_version),
        metrics=values,
    )
    return JsonResponse({"stored": stored})


@internal("POST")
def version(request, run: Run):
    jobs.job_report_version(run=run, version=_int(_body(request), "version"))
    return JsonResponse({"ok": True})


@internal("POST")
def checkpoints(request, run: Run):
    data = _body(request)
    path = data.get("path")
    if not isinstance(path, str) or not path:
        raise BadRequest("'path' must be the checkpoint's directory, a non-empty string")
    checkpoint = jobs.job_report_checkpoint(
        run=run,
        version=_int(data, "version"),
        step=_int(data, "step"),
        path=path,
        size_bytes=_int(data, "size_bytes", 0),
    )
    return JsonResponse({"version": checkpoint.version})


@internal("POST")
async def claim(request, run: Run):
    """Claim up to ``limit`` ready sessions; with ``wait_s``, wait that long for the first one.
    ``claim_id`` (optional): the job's id for this claim, the same in its retries, which then
    get the sessions it claimed rather than new ones."""
    data = _body(request)
    limit = _int(data, "limit", 1)
    if not 1 <= limit <= 10_000:
        raise BadRequest("'limit' must be between 1 and 10000")
    wait_s = _wait_s(data.get("wait_s", 0))
    token = data.get("claim_id", "")
    if not isinstance(token, str) or len(token) > 64:
        raise BadRequest("'claim_id' must be a string of at most 64 characters")
    sessions = await _long_poll(
        lambda: jobs.job_claim_trajectories(run=run, limit=limit, token=token), wait_s
    )
    # Submitted episodes that will never be rewarded (unscored, dropped), told once.
    unrewarded = await sync_to_async(jobs.job_take_unrewarded)(run=run)
    return JsonResponse({"sessions": sessions, "unrewarded": unrewarded})


@internal("GET")
async def watch(request, run: Run):
    """``{"status"}`` once the run's status is not ``?while=`` (or after ``?wait_s=``)."""
    unchanged = request.GET.get("while", "")
    wait_s = _wait_s(request.GET.get("wait_s", 0))

    def changed() -> str | None:
        status = jobs.job_run_status(run=run)
        return status if status != unchanged else None

    return JsonResponse({"status": await _long_poll(changed, wait_s) or unchanged})


@internal("POST")
def trained(request, run: Run):
    data = _body(request)
    jobs.job_mark_trained(
        run=run,
        version=_int(data, "version"),
        trained=_session_ids(data, "trained"),
        dropped=_session_ids(data, "dropped"),
    )
    return JsonResponse({"ok": True})


@internal("POST")
def release(request, run: Run):
    data = _body(request)
    ids = _session_ids(data, "sessions") if "sessions" in data else None
    return JsonResponse({"released": jobs.job_release(run=run, session_ids=ids)})


@internal("POST")
def hint_signals(request, run: Run):
    """What each session's hint did to its trained tokens (self-distillation, rl_core.hints)."""
    sessions = _body(request).get("sessions")
    if not isinstance(sessions, dict) or not all(_is_uuid(k) for k in sessions):
        raise BadRequest("'sessions' must map session ids to their signals")
    for value in sessions.values():
        parts = value.get("trajectories") if isinstance(value, dict) else None
        if not isinstance(parts, list) or not all(_signal_part(p) for p in parts):
            raise BadRequest(
                "each session's 'trajectories' must list {tokens, signal} of equal length"
            )
    return JsonResponse({"updated": jobs.job_hint_signals(run=run, sessions=sessions)})


def _signal_part(part) -> bool:
    tokens, signal = (part.get("tokens"), part.get("signal")) if isinstance(part, dict) else (0, 0)
    return (
        isinstance(tokens, list)
        and isinstance(signal, list)
        and len(tokens) == len(signal)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in signal)
    )


@internal("POST")
def episodes(request, run: Run):
    data = _body(request)
    items = data.get("episodes")
    if not isinstance(items, list):
        raise BadRequest("'episodes' must be a list")
    deferred = reward_is_deferred(run.config.get("reward"))
    episodes = [_episode(index, item, deferred=deferred) for index, item in enumerate(items)]
    return JsonResponse(
        {"sessions": jobs.job_submit_episodes(run=run, episodes=episodes)}, status=201
    )


@internal("POST")
def events(request, run: Run):
    data = _body(request)
    jobs.job_event(run=run, kind=_str(data, "kind", "job"), message=_str(data, "message"))
    return JsonResponse({"ok": True})


@internal("GET")
def evals(request, run: Run):
    """The run's finished evaluations and their numbers, which the job mirrors to its trackers
    (``rl_core.trackers``)."""
    from webapp.evals.models import Eval
    from webapp.evals.selectors import eval_list

    done = eval_list(run=run).filter(status=Eval.Status.DONE)
    return JsonResponse(
        {"evals": [{"id": str(e.id), "step": e.step} | _eval_numbers(e) for e in done]}
    )


def _eval_numbers(evaluation) -> dict[str, float]:
    names = ("examples", "mean_reward", "mean_reward_low", "mean_reward_high")
    names += ("pass_at_k", "pass_at_k_low", "pass_at_k_high")
    values = {name: getattr(evaluation, name) for name in names}
    return {"values": {name: float(v) for name, v in values.items() if v is not None}}


@internal("POST")
def resume(request, run: Run):
    """The job restored ``step``/``version`` (0/0: no checkpoint) and is about to serve."""
    data = _body(request)
    step, version = _int(data, "step"), _int(data, "version")
    if step < 0 or version < 0:
        raise BadRequest("'step' and 'version' must be 0 or more")
    return JsonResponse(jobs.job_resume(run=run, step=step, version=version))
