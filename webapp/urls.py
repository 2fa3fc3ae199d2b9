from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from webapp.docs_site import docs_page

urlpatterns = [
    path("api/v1/", include(("webapp.api.urls", "api"))),
    path("internal/v1/", include("webapp.runs.internal_urls")),
    path("internal/v1/", include("webapp.pools.internal_urls")),
    path("admin/", admin.site.urls),
    # Browsers ask for /favicon.ico whatever the page links; the icon is a static SVG.
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True)),
    # The documentation site (mkdocs.yml), built into DOCS_SITE_DIR.
    path("docs/", docs_page, name="docs"),
    path("docs/<path:path>", docs_page),
    path("", include("webapp.gateway.urls")),
    path("", include("webapp.pools.urls")),
    path("", include("webapp.dashboard.urls")),
]
