"""Times on the dashboard: relative in the text, the absolute time (with its zone) on hover."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.utils import timezone

from webapp.dashboard.templatetags.steep import ago, clock, duration


def test_ago_is_relative_with_the_absolute_time_in_its_title():
    when = timezone.now() - timedelta(minutes=3, seconds=5)
    html = str(ago(when))
    assert html.startswith(f'<time datetime="{when.isoformat()}" title="')
    assert f'title="{when.strftime("%Y-%m-%d %H:%M:%S")} UTC">3\xa0minutes ago</time>' in html
    assert ">just now<" in str(ago(timezone.now()))
    assert ago(None) == ""


def test_clock_is_short_with_the_full_date_on_hover():
    when = datetime(2025, 3, 1, 9, 5, 7, tzinfo=UTC)
    assert str(clock(when)) == (
        '<time datetime="2025-03-01T09:05:07+00:00" title="2025-03-01 09:05:07 UTC">09:05:07</time>'
    )


def test_duration_reads_as_seconds_minutes_or_hours():
    assert [duration(s) for s in (None, 4.4, 280, 3600 * 2 + 300)] == [
        "",
        "4 s",
        "4 min 40 s",
        "2 h 05 min",
    ]
