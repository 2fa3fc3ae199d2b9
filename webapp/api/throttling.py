"""REST API rate limit: ``RATE_LIMIT_API_PER_MIN`` requests per minute per project key
(per user for browser sessions). Over it: 429 with ``Retry-After``, in the API's error shape."""

from __future__ import annotations

from django.conf import settings
from rest_framework import exceptions
from rest_framework.throttling import BaseThrottle

from webapp import ratelimit


class KeyRateThrottle(BaseThrottle):
    def allow_request(self, request, view) -> bool:
        limit = settings.RATE_LIMIT_API_PER_MIN
        if limit <= 0:
            return True
        key = request.auth
        if key is not None and getattr(key, "pk", None) is not None:
            bucket, who = f"api:key:{key.pk}", "API key"
        elif request.user and request.user.is_authenticated and request.user.pk is not None:
            bucket, who = f"api:user:{request.user.pk}", "user"
        else:
            return True  # unauthenticated requests are refused before they cost anything
        limited = ratelimit.hit(bucket, limit=limit)
        if limited is None:
            return True
        raise exceptions.Throttled(
            wait=limited.retry_after,
            detail=f"Rate limit of {limit} requests per minute exceeded for this {who}.",
            code="rate_limited",
        )
