"""The pools page (staff): every pool, its servers, the runs on it and their adapters.

One view serves the page or, for htmx's refresh, the table alone. Anyone else gets a 404
(a pool's runs belong to many projects).
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render

from webapp.pools import selectors


@login_required
def pools(request):
    if not request.user.is_staff:
        raise Http404("No such page.")
    rows = [{"pool": pool, **selectors.pool_stats(pool=pool)} for pool in selectors.pool_list()]
    fragment = bool(request.htmx and not request.htmx.boosted)
    template = "pools/_pools_table.html" if fragment else "pools/pools.html"
    return render(request, template, {"rows": rows})
