"""REST authentication: a Bearer project key, or a logged-in member choosing a project."""

from __future__ import annotations

from rest_framework import authentication, exceptions, permissions

from webapp.accounts.selectors import project_get_for_user
from webapp.accounts.services import api_key_authenticate


def bearer_token(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class KeyUser:
    """The identity behind a project key: authenticated, not a Django user."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    pk = None

    def __init__(self, key):
        self.key = key
        self.username = f"key:{key.prefix}"

    def __str__(self) -> str:
        return self.username


class APIKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        token = bearer_token(header)
        if token is None:
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <project key>'.")
        key = api_key_authenticate(plaintext=token)
        if key is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked API key.")
        request.project = key.project
        return KeyUser(key), key

    def authenticate_header(self, request):
        return self.keyword


class HasProject(permissions.BasePermission):
    """Resolve ``request.project``: the key's project, or for a browser session the
    project named by the ``X-Steep-Project`` header (or ``?project=``) that the user is a member of."""

    def has_permission(self, request, view):
        if getattr(request, "project", None) is not None:
            return True
        user = request.user
        if not user or not user.is_authenticated:
            raise exceptions.NotAuthenticated(
                "Authenticate with 'Authorization: Bearer <project key>'."
            )
        project_id = request.META.get("HTTP_X_STEEP_PROJECT") or request.query_params.get("project")
        if not project_id:
            raise exceptions.ValidationError(
                {"project": ["Name the project with the X-Steep-Project header or ?project=<id>."]}
            )
        request.project = project_get_for_user(user=user, project_id=project_id)
        return True
