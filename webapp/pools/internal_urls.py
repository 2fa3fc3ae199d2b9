from django.urls import path

from webapp.pools import internal

urlpatterns = [
    path(f"pools/<str:pool_id>/{name}", getattr(internal, name), name=f"internal-pool-{name}")
    for name in ("config", "servers", "status", "watch")
]
