"""Request body limits, enforced before any view or parser reads the body; a database that is
down (restarting) answered as a retryable 503 instead of a 500."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse

logger = logging.getLogger(__name__)

# What a client waits before retrying while the database is unavailable (a restart takes seconds).
DATABASE_RETRY_AFTER_S = 1
DATABASE_UNAVAILABLE = "The database is unavailable (restarting?). Retry shortly."


def too_large_body(limit: int, *, openai_shape: bool) -> dict:
    """The 413 error body: OpenAI's shape for the gateway, the REST API's elsewhere."""
    message = f"Request body is larger than the limit of {limit} bytes."
    if openai_shape:
        return {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
    return {"error": {"message": message, "code": "request_too_large", "fields": {}}}


def too_large_response(limit: int, *, openai_shape: bool) -> JsonResponse:
    return JsonResponse(too_large_body(limit, openai_shape=openai_shape), status=413)


class BodySizeLimitMiddleware:
    """Answer 413 when Content-Length exceeds the route's limit.

    Dataset uploads get DATASET_MAX_BYTES (plus room for multipart framing);
    every other route gets MAX_REQUEST_BYTES. Bodies without a Content-Length
    are still capped by Django's DATA_UPLOAD_MAX_MEMORY_SIZE when read.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit = self.limit_for(request.path)
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > limit:
            return too_large_response(limit, openai_shape=request.path.startswith("/agents/"))
        return self.get_response(request)

    @staticmethod
    def limit_for(path: str) -> int:
        if "/datasets" in path:
            return settings.DATASET_MAX_BYTES + 64 * 1024
        return settings.MAX_REQUEST_BYTES


class DatabaseUnavailableMiddleware:
    """A view that failed because the database could not be reached (refused, the connection
    dropped by a restart) answers 503 with ``Retry-After``: the REST API's error shape, OpenAI's
    on the gateway's Django routes, plain text for pages. Django drops the broken connection at
    the end of the request, so the next one connects afresh. Nothing was acknowledged: a write
    that failed this way was rolled back with its transaction."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, OperationalError | InterfaceError):
            return None
        logger.error("database unavailable: %r", exception)
        return database_unavailable_response(request.path)


def database_unavailable_response(path: str) -> HttpResponse:
    headers = {"Retry-After": str(DATABASE_RETRY_AFTER_S)}
    if path.startswith("/agents/"):
        body = {
            "error": {
                "message": DATABASE_UNAVAILABLE,
                "type": "service_unavailable_error",
                "param": None,
                "code": "database_unavailable",
            }
        }
        return JsonResponse(body, status=503, headers=headers)
    if path.startswith(("/api/", "/internal/")):
        body = {
            "error": {"message": DATABASE_UNAVAILABLE, "code": "database_unavailable", "fields": {}}
        }
        return JsonResponse(body, status=503, headers=headers)
    return HttpResponse(
        DATABASE_UNAVAILABLE, status=503, headers=headers, content_type="text/plain"
    )
