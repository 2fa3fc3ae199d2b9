"""Template filters for times and paces: relative in the text, absolute on hover (``title``);
short model names, the full path on hover."""

from __future__ import annotations

from datetime import datetime
from pathlib import PurePosixPath

from django import template
from django.utils import timezone
from django.utils.dateformat import format as date_format
from django.utils.html import format_html
from django.utils.timesince import timesince

register = template.Library()

ABSOLUTE = "Y-m-d H:i:s T"


def _time(value: datetime, text: str):
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        value.isoformat(),
        date_format(local, ABSOLUTE),
        text,
    )


@register.filter
def ago(value: datetime | None):
    """``<time title="2025-01-31 12:00:05 UTC">3 minutes ago</time>``; empty for no time."""
    if not value:
        return ""
    seconds = (timezone.now() - value).total_seconds()
    return _time(value, "just now" if seconds < 60 else f"{timesince(value)} ago")


@register.filter
def clock(value: datetime | None, fmt: str = "H:i:s"):
    """A short absolute time (``fmt``), with the full date and zone on hover."""
    if not value:
        return ""
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    return _time(value, date_format(local, fmt))


@register.filter
def duration(seconds: float | None) -> str:
    """``4 min 40 s``, ``2 h 05 min``: a rough remaining time."""
    if seconds is None:
        return ""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@register.filter
def rate(value: float | None) -> str:
    """``12.4``, ``3``, ``1250``: a per-minute pace, one decimal below 100 (as run_live.js)."""
    if value is None:
        return ""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}".removesuffix(".0")


@register.filter
def model_name(value: str) -> str:
    """A model's short name: a local directory's last component (``/data/models/Qwen3-0.6B`` ->
    ``Qwen3-0.6B``); a Hugging Face id (``Qwen/Qwen3-0.6B``) stays whole, its owner is part of it."""
    if value.startswith(("/", ".", "~")):
        return PurePosixPath(value).name or value
    return value
