"""Plain dict shapes of run events, shared by the websocket and the internal API."""

from __future__ import annotations


def status_event(run) -> dict:
    return {
        "type": "status",
        "run_id": str(run.id),
        "status": run.status,
        "step": run.step,
        "weight_version": run.weight_version,
        "error": run.error,
    }


def metrics_event(run, points) -> dict:
    return {
        "type": "metrics",
        "run_id": str(run.id),
        "points": [{"step": p.step, "name": p.name, "value": p.value} for p in points],
    }
