"""Gateway errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from django.http import JsonResponse

from webapp.middleware import DATABASE_RETRY_AFTER_S, DATABASE_UNAVAILABLE

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "gone_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = (
            status,
            message,
            code,
            param,
            retry_after,
        )

    def payload(self) -> tuple[int, dict, dict[str, str]]:
        """``(status, body, headers)`` of the error response."""
        body = {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return self.status, body, headers

    def response(self) -> JsonResponse:
        status, body, headers = self.payload()
        return JsonResponse(body, status=status, headers=headers)


def database_unavailable(detail: str = "") -> GatewayError:
    """503 + Retry-After: the database could not take the request (restarting, unreachable)."""
    message = f"{detail} Retry shortly." if detail else DATABASE_UNAVAILABLE
    return GatewayError(
        503, message, code="database_unavailable", retry_after=DATABASE_RETRY_AFTER_S
    )


def bad_request(
    message: str, *, param: str | None = None, code: str = "invalid_value"
) -> GatewayError:
    return GatewayError(400, message, code=code, param=param)
