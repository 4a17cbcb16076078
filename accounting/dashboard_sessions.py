"""Sessions of the built-in dashboard, server-side in SQL, so every gateway replica shares them.

A session is a random token (`secrets.token_urlsafe(32)`), handed to the browser once as a cookie
(gateway/auth/dashboard_session.py). The table keeps only the token's SHA-256, when the session
ends, and a fingerprint of the admin key it was opened with. A session is valid while its row
exists, has not expired, and its fingerprint is the current admin key's: logging out deletes the
row, and changing the admin key ends every session at once.

The fingerprint is a scrypt hash of the admin key (a fixed, domain-separating salt, so every replica
computes the same one): someone who reads the table cannot cheaply test guesses of a weak
TOLLWAY_ADMIN_KEY against it. It is computed once per key and process.

Like the other accounting modules, every function works on a caller-owned `Session`: it flushes
but never commits.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from datetime import datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session

from accounting.models import DashboardSession, utcnow

DEFAULT_TTL = timedelta(hours=12)
MAX_TOKEN_LENGTH = 128  # a longer cookie is not ours: refused before hashing
_FINGERPRINT_SALT = b"tollway-dashboard-session-admin-key-v1"


@functools.lru_cache(maxsize=4)
def admin_key_fingerprint(admin_key: str) -> str:
    """A slow, salted hash of the admin key (scrypt, ~16 MiB and tens of ms, once per key)."""
    digest = hashlib.scrypt(admin_key.encode(), salt=_FINGERPRINT_SALT, n=2**14, r=8, p=1, dklen=32)
    return digest.hex()


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def open_session(session: Session, admin_key: str, ttl: timedelta = DEFAULT_TTL,
                 now: datetime | None = None) -> tuple[str, datetime]:
    """A new session for someone who presented `admin_key`: (its token, when it expires).
    Expired sessions are purged on the way."""
    now = now or utcnow()
    purge_expired(session, now)
    token = secrets.token_urlsafe(32)
    expires_at = now + ttl
    session.add(DashboardSession(token_hash=token_hash(token), admin_key_fingerprint=admin_key_fingerprint(admin_key),
                                 created_at=now, expires_at=expires_at))
    session.flush()
    return token, expires_at


def session_is_valid(session: Session, token: str, admin_key: str, now: datetime | None = None) -> bool:
    """Whether `token` names a live session opened with the current `admin_key`."""
    if not token or len(token) > MAX_TOKEN_LENGTH:
        return False
    row = session.get(DashboardSession, token_hash(token))
    if row is None or row.expires_at <= (now or utcnow()):
        return False
    return hmac.compare_digest(row.admin_key_fingerprint, admin_key_fingerprint(admin_key))


def close_session(session: Session, token: str) -> bool:
    """End the session `token` names (logout); False when there was none."""
    if not token or len(token) > MAX_TOKEN_LENGTH:
        return False
    result = session.execute(delete(DashboardSession).where(DashboardSession.token_hash == token_hash(token)))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def purge_expired(session: Session, now: datetime | None = None) -> int:
    """Delete every expired session; how many."""
    result = session.execute(delete(DashboardSession).where(DashboardSession.expires_at <= (now or utcnow())))
    return int(result.rowcount)  # type: ignore[attr-defined]
