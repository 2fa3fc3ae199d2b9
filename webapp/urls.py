from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("api/v1/", include(("webapp.api.urls", "api"))),
    path("internal/v1/", include("webapp.runs.internal_urls")),
    path("admin/", admin.site.urls),
    path("", include("webapp.gateway.urls")),
    path("", include("webapp.dashboard.urls")),
]
