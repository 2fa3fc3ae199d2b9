from django.contrib import admin, messages

from webapp.pools import services
from webapp.pools.models import Pool, PoolServer


class PoolServerInline(admin.TabularInline):
    model = PoolServer
    extra = 0
    readonly_fields = ["url", "backend", "registered_at"]
    can_delete = False


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ["name", "base_model", "backend", "replicas", "status", "updated_at"]
    list_filter = ["status", "backend"]
    readonly_fields = ["status", "error", "job_id", "job_secret_hash", "created_at", "updated_at"]
    inlines = [PoolServerInline]
    actions = ["start_pools", "stop_pools"]

    @admin.action(description="Start the selected pools")
    def start_pools(self, request, queryset):
        for pool in queryset:
            try:
                services.pool_start(pool=pool)
            except services.IllegalPoolTransition as exc:
                self.message_user(request, str(exc), messages.WARNING)

    @admin.action(description="Stop the selected pools")
    def stop_pools(self, request, queryset):
        for pool in queryset:
            try:
                services.pool_stop(pool=pool)
            except services.IllegalPoolTransition as exc:
                self.message_user(request, str(exc), messages.WARNING)
