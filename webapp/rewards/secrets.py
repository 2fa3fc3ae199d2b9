"""A run's credentials at rest: encrypted with a key derived from ``SECRET_KEY``, never shown.

A run created with ``reward.api_key`` (a judge's key) stores ``reward.api_key_encrypted``
(Fernet: AES-128-CBC with an HMAC) instead; ``api_key_env`` keeps the key out of the database
altogether. The experiment trackers' credentials (``trackers.wandb.api_key``,
``trackers.mlflow.tracking_token``, ``rl_core.tracker_specs.SECRETS``) are sealed the same way
and handed decrypted to the run's job only. Changing ``SECRET_KEY`` makes stored keys
unreadable: the judge then reports an outage naming the fix, a tracker fails (and the run goes
on without it).
"""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

REDACTED = "(stored encrypted)"


class KeyUnavailable(Exception):
    """The judge's key cannot be had now (an unset variable, an undecryptable key)."""


def _fernet() -> Fernet:
    digest = hashlib.sha256(b"steep-judge-key:" + settings.SECRET_KEY.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def _secret_places(config: dict[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """Where ``config`` may hold a credential: (the path to its object, the credential's name)."""
    from rl_core.tracker_specs import SECRETS

    return [(("reward",), "api_key")] + [
        (("trackers", tracker), name) for tracker, name in SECRETS.items()
    ]


def _replace(config: dict[str, Any], path: tuple[str, ...], value: dict) -> dict[str, Any]:
    if len(path) == 1:
        return config | {path[0]: value}
    return config | {path[0]: _replace(config[path[0]], path[1:], value)}


def _at(config: dict[str, Any], path: tuple[str, ...]) -> dict | None:
    for key in path:
        config = config.get(key) if isinstance(config, dict) else None  # type: ignore[assignment]
    return config if isinstance(config, dict) else None


def seal_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run config to store: each plaintext credential replaced by its ciphertext."""
    for path, name in _secret_places(config):
        spec = _at(config, path)
        if spec is None or name not in spec:
            continue
        sealed = {k: v for k, v in spec.items() if k != name}
        sealed[f"{name}_encrypted"] = _fernet().encrypt(spec[name].encode()).decode()
        config = _replace(config, path, sealed)
    return config


def redact_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run config to show: no credential, not even its ciphertext."""
    for path, name in _secret_places(config):
        spec = _at(config, path)
        if spec is None or not ({name, f"{name}_encrypted"} & set(spec)):
            continue
        shown = {k: v for k, v in spec.items() if k not in (name, f"{name}_encrypted")}
        config = _replace(config, path, shown | {name: REDACTED})
    return config


def unseal(spec: dict[str, Any], name: str) -> str:
    """The credential ``name`` of ``spec`` (a tracker's options) in plain text; empty when
    there is none; ``KeyUnavailable`` when it cannot be decrypted."""
    if not (token := spec.get(f"{name}_encrypted")):
        return spec.get(name, "")
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        raise KeyUnavailable(
            f"the stored {name} cannot be decrypted (SECRET_KEY changed?): create the run again"
            " with it"
        ) from None


def judge_api_key(spec: dict[str, Any]) -> str:
    """The key to send to the judge: from the environment, the stored ciphertext, or none."""
    if name := spec.get("api_key_env"):
        value = os.environ.get(name)
        if not value:
            raise KeyUnavailable(
                f"the judge's key variable {name} is not set in the worker's environment"
            )
        return value
    if token := spec.get("api_key_encrypted"):
        try:
            return _fernet().decrypt(token.encode()).decode()
        except InvalidToken:
            raise KeyUnavailable(
                "the judge's stored key cannot be decrypted (SECRET_KEY changed?): create the"
                " run again with its key, or use api_key_env"
            ) from None
    return "none"  # an endpoint without keys; the SDK needs a value
