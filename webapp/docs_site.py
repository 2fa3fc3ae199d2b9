"""``/docs/``: the documentation site, as ``mkdocs build`` left it in ``DOCS_SITE_DIR``.

The site is a tree of static files (mkdocs.yml builds ``docs/`` into it: ``./steep up`` and the
Docker image do, ``./steep docs`` by hand). Until it is built, ``/docs/`` says how to build it.
A path it lacks gets Steep's own 404 page (mkdocs' own links its assets from the server's root,
not from ``/docs/``).
Pages are small and read whole: a response of bytes, nothing for the ASGI handler to iterate
in a thread.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from django.conf import settings
from django.core.exceptions import SuspiciousFileOperation
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.utils._os import safe_join
from django.views.decorators.http import require_safe


@require_safe
def docs_page(request: HttpRequest, path: str = "") -> HttpResponse:
    """A file of the built site; a folder's ``index.html`` (after a redirect to its ``/``, so
    the page's relative links resolve); a 404 page for anything else."""
    root = Path(settings.DOCS_SITE_DIR)
    if not (root / "index.html").is_file():
        return _not_found(request, built=False)
    try:
        target = Path(safe_join(root, path))
    except SuspiciousFileOperation:
        return _not_found(request)
    if target.is_dir():
        if path and not path.endswith("/"):
            return HttpResponseRedirect(request.path + "/")
        target = target / "index.html"
    if not target.is_file():
        return _not_found(request)
    content_type, encoding = mimetypes.guess_type(target.name)
    if encoding or not content_type:  # sitemap.xml.gz is a file to download, not to inflate
        content_type = "application/octet-stream"
    elif content_type.startswith("text/"):
        content_type += "; charset=utf-8"
    return HttpResponse(target.read_bytes(), content_type=content_type)


def _not_found(request: HttpRequest, *, built: bool = True) -> HttpResponse:
    return render(request, "docs_404.html", {"built": built}, status=404)
