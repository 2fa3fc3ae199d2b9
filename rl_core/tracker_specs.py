"""The ``trackers`` run setting: which experiment trackers mirror a run, and with what options.

Shared by ``rl_core.config`` (validation), the web app (the instance default ``STEEP_TRACKERS``,
credentials sealed at rest) and the run's job (``rl_core.trackers``, which does the mirroring).
No tracker library is imported here: this module is on the web process's path.

A spec maps a tracker's name to its options (``{}`` or ``true``: the defaults) or to ``false``,
which turns off a tracker the instance turns on for every run::

    {"wandb": {"project": "letters", "mode": "offline"},
     "mlflow": {"tracking_uri": "https://mlflow.example.com", "experiment": "letters"},
     "tensorboard": {}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

TRACKERS = ("wandb", "mlflow", "tensorboard")
LABELS = {"wandb": "Weights & Biases", "mlflow": "MLflow", "tensorboard": "TensorBoard"}
WANDB_MODES = ("online", "offline")
# Each tracker's credential: given in plain text once, stored as ``<name>_encrypted``
# (webapp.rewards.secrets), handed decrypted to the run's job only.
SECRETS = {"wandb": "api_key", "mlflow": "tracking_token"}
OPTIONS: dict[str, dict[str, type]] = {
    "wandb": {
        "project": str,
        "entity": str,
        "mode": str,
        "base_url": str,
        "tags": list,
        "log_checkpoints": bool,
        "api_key": str,
        "api_key_encrypted": str,
    },
    "mlflow": {
        "tracking_uri": str,
        "experiment": str,
        "log_checkpoints": bool,
        "tracking_token": str,
        "tracking_token_encrypted": str,
    },
    "tensorboard": {},
}
# What a run (a tenant) may name as its MLflow store: a server. A file or database store is a
# path on the machines Steep runs on, which only the operator chooses (STEEP_TRACKERS); a run
# without one gets a file store under its own directory.
CREDENTIAL_KEYS = {"api_key", "api_key_encrypted", "tracking_token", "tracking_token_encrypted"}
RUN_MLFLOW_SCHEMES = ("http://", "https://", "databricks")


def tracker_spec_errors(spec: Any, *, instance: bool = False) -> list[str]:
    """What is wrong with a ``trackers`` spec, each message saying what to set instead.

    ``instance``: the operator's ``STEEP_TRACKERS``, which may name any MLflow store."""
    if not isinstance(spec, dict):
        return ['trackers must be a JSON object, e.g. {"tensorboard": {}}.']
    errors: list[str] = []
    for name, options in spec.items():
        if name not in TRACKERS:
            errors.append(f"Unknown tracker '{name}': use {', '.join(TRACKERS)}.")
            continue
        if isinstance(options, bool):
            continue
        if not isinstance(options, dict):
            errors.append(f"trackers.{name} must be an object of options, true or false.")
            continue
        errors += _option_errors(name, options, instance=instance)
    return errors


def _option_errors(name: str, options: dict, *, instance: bool) -> list[str]:
    known = OPTIONS[name]
    errors = []
    for key, value in options.items():
        if key not in known:
            allowed = ", ".join(k for k in known if not k.endswith("_encrypted")) or "none"
            errors.append(f"trackers.{name} has no option '{key}'; its options: {allowed}.")
        elif not isinstance(value, known[key]):
            errors.append(f"trackers.{name}.{key} must be a {known[key].__name__}.")
    if errors:
        return errors
    secret = SECRETS.get(name)
    if secret and secret in options and f"{secret}_encrypted" in options:
        errors.append(f"trackers.{name}: give {secret} once (it is stored encrypted).")
    if name == "wandb":
        if options.get("mode", "") not in ("", *WANDB_MODES):
            errors.append("trackers.wandb.mode must be online or offline.")
        if not all(isinstance(t, str) for t in options.get("tags", [])):
            errors.append("trackers.wandb.tags must be a list of strings.")
        if options.get("base_url", "") and not options["base_url"].startswith(
            ("http://", "https://")
        ):
            errors.append("trackers.wandb.base_url is a W&B server's http(s):// URL.")
    if name == "mlflow" and not instance:
        uri = options.get("tracking_uri", "")
        if uri and not uri.startswith(RUN_MLFLOW_SCHEMES):
            errors.append(
                "trackers.mlflow.tracking_uri must be an MLflow server (http:// or https://) or"
                " databricks: a file or database store is a path on Steep's machines, which only"
                " the operator sets (STEEP_TRACKERS). Leave it empty for a file store in the"
                " run's own directory."
            )
    return errors


def parse_instance_trackers(value: str) -> dict[str, Any]:
    """``STEEP_TRACKERS``: a spec as JSON, or tracker names separated by commas
    (``tensorboard,mlflow``); ``ValueError`` saying what is wrong."""
    value = value.strip()
    if not value:
        return {}
    if value.startswith("{"):
        try:
            spec = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"STEEP_TRACKERS is not valid JSON: {exc}") from None
    else:
        spec = {name.strip(): {} for name in value.split(",") if name.strip()}
    if errors := tracker_spec_errors(spec, instance=True):
        raise ValueError("STEEP_TRACKERS: " + " ".join(errors))
    return spec


def effective_trackers(instance: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, dict]:
    """The trackers a run mirrors to and their options: the instance's default, each tracker's
    options overridden by the run's, ``false`` in either turning one off."""
    merged: dict[str, dict] = {}
    for spec in (instance, run):
        for name, options in spec.items():
            if options is False:
                merged.pop(name, None)
            else:
                merged[name] = merged.get(name, {}) | (options if isinstance(options, dict) else {})
    return {name: merged[name] for name in TRACKERS if name in merged}


def tracker_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run config as trackers' flat parameters (``reward.type``, ``learning_rate``), without
    the trackers' own settings or any credential, even encrypted."""
    params: dict[str, Any] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if key not in CREDENTIAL_KEYS:
                    add(f"{prefix}.{key}" if prefix else key, inner)
        elif isinstance(value, list):
            params[prefix] = json.dumps(value)
        else:
            params[prefix] = value

    add("", {k: v for k, v in config.items() if k != "trackers"})
    return params
