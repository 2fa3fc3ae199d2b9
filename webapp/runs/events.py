"""Live run events over websockets: their dict shapes and the one place that publishes them.

The same shapes go to the websocket (consumers only forward) and into the snapshot a
consumer sends on connect."""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)


def status_event(run) -> dict:
    return {
        "type": "status",
        "run_id": str(run.id),
        "status": run.status,
        "step": run.step,
        "weight_version": run.weight_version,
        "error": run.error,
        "queue_reason": run.queue_reason,
    }


def metrics_event(run, points) -> dict:
    return {
        "type": "metrics",
        "run_id": str(run.id),
        "points": [
            {"step": p.step, "name": p.name, "value": p.value, "t": p.created_at.timestamp()}
            for p in points
        ],
    }


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
