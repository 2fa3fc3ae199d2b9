"""Reads for projects and keys. Every read is scoped: a project's objects, or a user's projects."""

from __future__ import annotations

import uuid

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.http import Http404

from webapp.accounts.models import APIKey, Membership, Project


def parse_uuid(value) -> uuid.UUID:
    """A UUID from user input; anything malformed is simply not found."""
    try:
        return uuid.UUID(str(value))
    except (TypeError, ValueError, AttributeError):
        raise Http404("Not found.") from None


def project_list_for_user(*, user: AbstractBaseUser) -> QuerySet[Project]:
    return Project.objects.filter(memberships__user=user).order_by("name")


def project_get_for_user(*, user: AbstractBaseUser, project_id) -> Project:
    project = Project.objects.filter(pk=parse_uuid(project_id), memberships__user=user).first()
    if project is None:
        raise Http404("Project not found.")
    return project


def membership_role(*, project: Project, user: AbstractBaseUser) -> str | None:
    membership = Membership.objects.filter(project=project, user=user).first()
    return membership.role if membership else None


def api_key_list(*, project: Project) -> QuerySet[APIKey]:
    return APIKey.objects.filter(project=project).order_by("-created_at")


def api_key_get(*, project: Project, key_id) -> APIKey:
    key = APIKey.objects.filter(project=project, pk=parse_uuid(key_id)).first()
    if key is None:
        raise Http404("API key not found.")
    return key
