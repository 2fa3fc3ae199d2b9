"""``{% run_trackers run as trackers %}``: the run page's tracker notice
(``templates/dashboard/_run_trackers.html``), without a change to the page's view."""

from __future__ import annotations

from django import template

from webapp.runs.trackers import tracker_notices

register = template.Library()


@register.simple_tag
def run_trackers(run) -> list[dict]:
    return tracker_notices(run)
