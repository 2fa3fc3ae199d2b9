"""Live run events over websockets. The one place that publishes; consumers only forward."""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)


def run_group(run_id) -> str:
    return f"run-{run_id}"


def publish_run_event(run_id, event: dict) -> None:
    """Send ``event`` (a JSON-able dict with a ``type`` such as ``metrics`` or ``status``) to the run's watchers."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(run_group(run_id), {"type": "run.event", "event": event})
    except Exception:  # a dashboard update must never fail the report that caused it
        logger.exception("could not publish an event for run %s", run_id)
