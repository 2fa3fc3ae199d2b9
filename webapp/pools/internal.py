"""The internal API a pool's Ray job talks to: ``/internal/v1/pools/<pool_id>/...``.

Authenticated with the pool's job secret (``Bearer steep-pool-...``), issued afresh at
every launch; the same network rule as the runs' internal API. The job reads its
settings (``config``), registers its servers (``servers``), reports its status
(``status``) and long-polls ``watch`` for a scale or a stop.
"""

from __future__ import annotations

import uuid

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from webapp.accounts.auth import bearer_token
from webapp.pools import services
from webapp.pools.models import Pool
from webapp.runs.internal import BadRequest, _body, _error, _long_poll, _network_allowed, _wait_s


def _admit(request: HttpRequest, pool_id: str, method: str) -> Pool | JsonResponse:
    if not _network_allowed(request):
        return _error(403, "the internal API is not reachable from this network")
    if request.method != method:
        return _error(405, f"use {method}")
    try:
        uuid.UUID(pool_id)
    except ValueError:
        return _error(401, "invalid job secret for this pool")
    pool = services.pool_job_authenticate(
        pool_id=pool_id, token=bearer_token(request.headers.get("Authorization", ""))
    )
    if pool is None:
        return _error(401, "invalid job secret for this pool")
    return pool


def _admit_post(request: HttpRequest, pool_id: str) -> tuple[Pool, dict] | JsonResponse:
    """``_admit`` for a POST, with its JSON body."""
    pool = _admit(request, pool_id, "POST")
    if isinstance(pool, JsonResponse):
        return pool
    try:
        return pool, _body(request)
    except BadRequest as exc:
        return _error(400, str(exc))


@csrf_exempt
def config(request: HttpRequest, pool_id: str):
    pool = _admit(request, pool_id, "GET")
    if isinstance(pool, JsonResponse):
        return pool
    return JsonResponse(
        {
            "pool_id": str(pool.id),
            "name": pool.name,
            "base_model": pool.base_model,
            "backend": pool.backend,
            "replicas": pool.replicas,
            "tensor_parallel": pool.tensor_parallel,
            "status": pool.status,
            "max_lora_rank": pool.max_lora_rank,
            "lora_target_modules": pool.lora_target_modules,
            "max_loaded_adapters": pool.max_loaded_adapters,
            "run_weights": pool.run_weights,
        }
    )


@csrf_exempt
def servers(request: HttpRequest, pool_id: str):
    admitted = _admit_post(request, pool_id)
    if isinstance(admitted, JsonResponse):
        return admitted
    pool, data = admitted
    url, action = data.get("url"), data.get("action", "register")
    if not isinstance(url, str) or not url.startswith("http"):
        return _error(400, "'url' must be an http(s) URL")
    if action not in ("register", "unregister"):
        return _error(400, "'action' must be register or unregister")
    if action == "register":
        backend = data.get("backend", "torch")
        if backend not in ("torch", "sglang", "vllm"):
            return _error(400, "'backend' must be torch, sglang or vllm")
        services.pool_server_register(pool=pool, url=url, backend=backend)
    else:
        services.pool_server_unregister(pool=pool, url=url)
    return JsonResponse({"ok": True})


@csrf_exempt
def status(request: HttpRequest, pool_id: str):
    admitted = _admit_post(request, pool_id)
    if isinstance(admitted, JsonResponse):
        return admitted
    pool, data = admitted
    target, error = data.get("status"), data.get("error", "")
    if target not in (Pool.Status.RUNNING, Pool.Status.STOPPED, Pool.Status.FAILED):
        return _error(400, "'status' must be running, stopped or failed")
    if not isinstance(error, str):
        return _error(400, "'error' must be a string")
    try:
        pool = services.pool_job_report_status(pool=pool, status=target, error=error)
    except services.IllegalPoolTransition as exc:
        return _error(409, str(exc))
    return JsonResponse({"status": pool.status})


@csrf_exempt
async def watch(request: HttpRequest, pool_id: str):
    """``{"replicas", "status", "run_weights"}`` once replicas or status differ from
    ``?replicas=&status=`` (or after ``?wait_s=``): a weight change waits for the next answer."""
    pool = await sync_to_async(_admit)(request, pool_id, "GET")
    if isinstance(pool, JsonResponse):
        return pool
    try:
        wait_s = _wait_s(request.GET.get("wait_s", 0))
        replicas = int(request.GET.get("replicas", "-1"))
    except (BadRequest, ValueError) as exc:
        return _error(400, str(exc) or "'replicas' must be a whole number")
    status_now = request.GET.get("status", "")

    def changed() -> dict | None:
        row = Pool.objects.filter(pk=pool.pk).values("replicas", "status", "run_weights").get()
        return row if (row["replicas"], row["status"]) != (replicas, status_now) else None

    row = await _long_poll(changed, wait_s)
    if row is None:
        row = await sync_to_async(
            lambda: (
                Pool.objects.filter(pk=pool.pk).values("replicas", "status", "run_weights").get()
            )
        )()
    return JsonResponse(row)
