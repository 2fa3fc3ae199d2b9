"""``/healthz`` (the process is up) and ``/readyz`` (it can serve: database, broker, Ray).

Answered by a middleware placed before host validation, the HTTPS redirect and the
session machinery: probes from a load balancer, Docker or Kubernetes use whatever
Host header they like (a pod IP), plain HTTP, and no cookies. Neither page says more
than which check failed and the exception's type; the details go to the log.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.utils.decorators import sync_and_async_middleware

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0


def healthz(request) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def check_database() -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        if not connection.in_atomic_block:  # a probe holds no connection between probes
            connection.close()


def check_broker() -> None:
    """Redis answers PING; without Redis, the file-system broker's folder is writable."""
    if settings.REDIS_URL:
        import redis

        client = redis.Redis.from_url(
            settings.REDIS_URL,
            socket_timeout=CHECK_TIMEOUT_S,
            socket_connect_timeout=CHECK_TIMEOUT_S,
        )
        try:
            client.ping()
        finally:
            client.close()
        return
    with tempfile.NamedTemporaryFile(dir=Path(settings.DATA_DIR) / "broker", prefix=".readyz-"):
        pass


def check_ray() -> None:
    """The cluster's Jobs API answers, and accepts our token when token auth is on."""
    import os

    import httpx

    from workers.ray_cluster import dashboard_url

    url = dashboard_url(settings.RAY_ADDRESS, dashboard_port=settings.RAY_LOCAL_DASHBOARD_PORT)
    token = os.environ.get("RAY_AUTH_TOKEN", "")
    if not token and os.environ.get("RAY_AUTH_TOKEN_PATH"):
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(f"{url}/api/version", headers=headers, timeout=CHECK_TIMEOUT_S)
    response.raise_for_status()


def _checks() -> dict[str, Callable[[], None]]:
    checks = {"database": check_database, "broker": check_broker}
    if settings.RAY_ADDRESS:  # the embedded Ray head is started on demand, not checked
        checks["ray"] = check_ray
    return checks


def readiness() -> tuple[bool, dict[str, dict]]:
    results = {}
    for name, check in _checks().items():
        started = time.perf_counter()
        try:
            check()
        except Exception as exc:  # noqa: BLE001 (every failure is a "not ready")
            logger.warning("readiness check %s failed: %s: %s", name, type(exc).__name__, exc)
            results[name] = {"ok": False, "error": type(exc).__name__}
        else:
            results[name] = {"ok": True}
        results[name]["ms"] = round((time.perf_counter() - started) * 1000, 1)
    return all(result["ok"] for result in results.values()), results


def readyz(request) -> JsonResponse:
    ready, checks = readiness()
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks},
        status=200 if ready else 503,
    )


_PAGES = {"/healthz": healthz, "/readyz": readyz}


@sync_and_async_middleware
def health_middleware(get_response):
    if iscoroutinefunction(get_response):

        async def middleware(request):
            page = _PAGES.get(request.path_info.rstrip("/"))
            if page is healthz:
                return healthz(request)
            if page is readyz:
                # Not in the thread sync views share: a hanging check must not hold them up.
                return await sync_to_async(readyz, thread_sensitive=False)(request)
            return await get_response(request)

    else:

        def middleware(request):
            page = _PAGES.get(request.path_info.rstrip("/"))
            if page is not None:
                return page(request)
            return get_response(request)

    return middleware
