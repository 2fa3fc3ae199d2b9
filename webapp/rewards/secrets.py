"""A judge's API key at rest: encrypted with a key derived from ``SECRET_KEY``, never shown.

A run created with ``reward.api_key`` stores ``reward.api_key_encrypted`` (Fernet: AES-128-CBC
with an HMAC) instead; ``api_key_env`` keeps the key out of the database altogether. Changing
``SECRET_KEY`` makes stored keys unreadable: the judge then reports an outage naming the fix.
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


def seal_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run config to store: a judge's plaintext ``api_key`` replaced by its ciphertext."""
    reward = config.get("reward")
    if not isinstance(reward, dict) or "api_key" not in reward:
        return config
    sealed = {k: v for k, v in reward.items() if k != "api_key"}
    sealed["api_key_encrypted"] = _fernet().encrypt(reward["api_key"].encode()).decode()
    return config | {"reward": sealed}


def redact_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run config to show: no key, not even its ciphertext."""
    reward = config.get("reward")
    if not isinstance(reward, dict) or not ({"api_key", "api_key_encrypted"} & set(reward)):
        return config
    shown = {k: v for k, v in reward.items() if k not in ("api_key", "api_key_encrypted")}
    return config | {"reward": shown | {"api_key": REDACTED}}


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
