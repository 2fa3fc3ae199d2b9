"""Writes for users, projects and keys."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from webapp.accounts.keys import display_prefix, generate_key, hash_key
from webapp.accounts.models import APIKey, Membership, Project

LAST_USED_RESOLUTION = timedelta(minutes=1)


class ProjectNameTaken(Exception):
    """Project names are unique across the installation."""


def project_create(*, name: str, owner: AbstractBaseUser | None = None) -> Project:
    """A new project, owned by ``owner``; ProjectNameTaken when another project has ``name``."""
    if Project.objects.filter(name=name).exists():
        raise ProjectNameTaken(name)
    with transaction.atomic():
        project = Project.objects.create(name=name)
        if owner is not None:
            Membership.objects.create(project=project, user=owner, role=Membership.Role.OWNER)
    return project


def project_add_member(
    *, project: Project, user: AbstractBaseUser, role: str = Membership.Role.MEMBER
) -> Membership:
    membership, _ = Membership.objects.get_or_create(
        project=project, user=user, defaults={"role": role}
    )
    return membership


def api_key_create(
    *,
    project: Project,
    name: str = "",
    user: AbstractBaseUser | None = None,
    expires_at: datetime | None = None,
) -> tuple[APIKey, str]:
    """Create a key and return it with its plaintext, which is never stored or shown again."""
    plaintext = generate_key()
    key = APIKey.objects.create(
        project=project,
        name=name,
        prefix=display_prefix(plaintext),
        hashed=hash_key(plaintext),
        created_by=user,
        expires_at=expires_at,
    )
    return key, plaintext


def api_key_revoke(*, key: APIKey) -> APIKey:
    key.revoke()
    return key


def api_key_authenticate(*, plaintext: str) -> APIKey | None:
    """The active key matching ``plaintext``, or None. Touches ``last_used_at`` at most once a minute."""
    if not plaintext:
        return None
    key = APIKey.objects.select_related("project").filter(hashed=hash_key(plaintext)).first()
    if key is None or not key.is_active:
        return None
    now = timezone.now()
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        APIKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key


def user_get_or_create(*, username: str, password: str | None = None, is_superuser: bool = False):
    User = get_user_model()
    user, created = User.objects.get_or_create(username=username)
    if created:
        if password:
            user.set_password(password)
        else:
            user.set_unusable_password()
        user.is_staff = user.is_superuser = is_superuser
        user.save()
    return user, created


def bootstrap_project(
    *, project_name: str, username: str | None = None
) -> tuple[Project, AbstractBaseUser | None]:
    """Get or create a project (and its owner) by name; used by automation commands."""
    user = None
    if username:
        user, _ = user_get_or_create(username=username)
    project = Project.objects.filter(name=project_name).first()
    if project is None:
        project = project_create(name=project_name, owner=user)
    elif user is not None:
        project_add_member(project=project, user=user, role=Membership.Role.OWNER)
    return project, user
