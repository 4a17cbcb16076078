"""API key format, hashing and display.

A key is `tw-` followed by 43 URL-safe base64 characters (32 random bytes). Only its SHA-256 hex
digest is stored; the plaintext is shown to the operator once and never stored or logged.
"""

from __future__ import annotations

import hashlib
import re
import secrets

KEY_PREFIX = "tw-"
KEY_RANDOM_BYTES = 32
DISPLAY_PREFIX_LENGTH = 10
"""Characters of a key shown in listings (`tw-` + 7): enough to tell keys apart, useless to attackers."""

# token_urlsafe(32) gives exactly 43 characters; accept longer in case the size grows later.
_KEY_PATTERN = re.compile(r"tw-[A-Za-z0-9_-]{43,128}")


def generate_api_key() -> str:
    """A new random API key (plaintext)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def hash_api_key(key: str) -> str:
    """The SHA-256 hex digest of `key`, as stored in `api_keys.key_hash`."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def display_prefix(key: str) -> str:
    """The first characters of `key`, safe to store and show (e.g. `tw-AbCdEfG`)."""
    return key[:DISPLAY_PREFIX_LENGTH]


def looks_like_api_key(text: str) -> bool:
    """A cheap syntactic check (no database): does `text` have the shape of a tollway key?"""
    return _KEY_PATTERN.fullmatch(text) is not None
