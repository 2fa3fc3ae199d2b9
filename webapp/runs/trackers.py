"""A run's experiment trackers as the web app sees them: what its job is handed, what its page says.

The mirroring itself happens in the run's job (``rl_core.trackers``), where each step's metrics
are at hand and the trackers' libraries stay out of the web process. The web app resolves which
trackers a run uses (``STEEP_TRACKERS`` under the run's ``trackers`` setting) and hands the job
their credentials, decrypted; the job reports a tracker that failed as a run event of kind
``tracker``, which the run page shows (``templates/dashboard/_run_trackers.html``).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from rl_core.tracker_specs import LABELS, SECRETS, effective_trackers
from webapp.rewards.secrets import KeyUnavailable, unseal
from webapp.runs.models import Run, RunEvent

EVENT_KIND = "tracker"  # what the job reports a failed tracker as (rl_core.trackers)
_INSTANCE_SECRETS = {"wandb": "STEEP_WANDB_API_KEY", "mlflow": "STEEP_MLFLOW_TRACKING_TOKEN"}


def run_trackers(run: Run) -> dict[str, dict]:
    """The trackers ``run`` mirrors to, with their options as stored (credentials sealed)."""
    return effective_trackers(settings.STEEP_TRACKERS, run.config.get("trackers") or {})


def job_trackers(run: Run) -> dict[str, dict]:
    """What the run's job is handed: each tracker's options with its credential in plain text
    (the run's own, else the instance's); one that cannot be decrypted becomes an ``error``,
    which fails that tracker alone."""
    handed = {}
    for name, stored in run_trackers(run).items():
        secret = SECRETS.get(name)
        options = {k: v for k, v in stored.items() if not k.endswith("_encrypted")}
        if secret:
            try:
                value = unseal(stored, secret) or getattr(settings, _INSTANCE_SECRETS[name])
            except KeyUnavailable as exc:
                options["error"] = str(exc)
            else:
                options.pop(secret, None)
                if value:
                    options[secret] = value
        handed[name] = options
    return handed


def tracker_notices(run: Run) -> list[dict[str, Any]]:
    """For the run page: each tracker the run mirrors to, and why one stopped, if it did."""
    trackers = run_trackers(run)
    if not trackers:
        return []
    failed = {
        event.message.partition(":")[0]: event.message
        for event in RunEvent.objects.filter(run=run, kind=EVENT_KIND).order_by("created_at")
    }
    return [
        {"name": name, "label": LABELS[name], "failed": failed.get(LABELS[name], "")}
        for name in trackers
    ]
