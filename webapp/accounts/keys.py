"""Key material: generation and hashing. Keys are 256-bit random, so a plain SHA-256 suffices."""

from __future__ import annotations

import hashlib
import secrets

PROJECT_KEY_PREFIX = "sk-steep-"
SESSION_KEY_PREFIX = "sk-steep-sess-"
DISPLAY_PREFIX_LENGTH = 16


def generate_key(prefix: str = PROJECT_KEY_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(32)


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def display_prefix(plaintext: str) -> str:
    return plaintext[:DISPLAY_PREFIX_LENGTH]
