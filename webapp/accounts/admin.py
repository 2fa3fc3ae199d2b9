from django.contrib import admin

from webapp.accounts.models import APIKey, Membership, Project


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "created_at"]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["project", "user", "role"]


@admin.register(APIKey)
class APIKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "project", "name", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["prefix", "hashed"]
