"""Request body limits, enforced before any view or parser reads the body."""

from __future__ import annotations

from django.conf import settings
from django.http import JsonResponse


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
