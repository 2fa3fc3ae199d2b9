"""One error shape for the REST API: ``{"error": {"message", "code", "fields"}}``."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the object's current state."
    default_code = "conflict"


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "request_too_large"


def _flatten(detail) -> str:
    if isinstance(detail, list):
        return " ".join(_flatten(item) for item in detail)
    if isinstance(detail, dict):
        return " ".join(f"{key}: {_flatten(value)}" for key, value in detail.items())
    return str(detail)


def _fields(detail) -> dict:
    if isinstance(detail, dict):
        return {
            key: value if isinstance(value, list | dict) else [str(value)]
            for key, value in detail.items()
        }
    return {}


def exception_handler(exc, context):
    if isinstance(exc, RequestDataTooBig):
        exc = PayloadTooLarge()
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    detail = response.data
    if isinstance(exc, exceptions.ValidationError):
        fields = _fields(detail)
        message = "Invalid input: " + _flatten(detail) if fields else _flatten(detail)
        code = "invalid"
    else:
        fields = {}
        message = _flatten(detail.get("detail", detail) if isinstance(detail, dict) else detail)
        code = getattr(exc, "default_code", "error")
        if isinstance(getattr(exc, "detail", None), exceptions.ErrorDetail):
            code = exc.detail.code or code
    body = {"error": {"message": message, "code": code, "fields": fields}}
    headers = {}
    for name in ("WWW-Authenticate", "Retry-After"):
        if name in response:
            headers[name] = response[name]
    return Response(body, status=response.status_code, headers=headers)
