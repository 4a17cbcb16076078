"""API keys in the database (the `api_keys` table): create, list, revoke, rotate, authenticate.

A key's format and hashing are `accounting.keys`; its tenant is administered by
`accounting.tenants`, whose rules hold here too: every function works on a caller-owned `Session`
(it flushes but never commits or rolls back), and invalid input raises an `AccountingError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from accounting.keys import display_prefix, generate_api_key, hash_api_key
from accounting.models import ApiKey, Tenant, utcnow
from accounting.tenants import (
    AccountingError,
    InvalidQuotaError,
    NotFoundError,
    check_aware,
    check_quota,
    get_tenant,
)

KEY_NAME_MAX_LENGTH = 200
_KEY_HASH = re.compile(r"[0-9a-f]{64}")


class KeyNotFoundError(NotFoundError):
    """No API key has that id."""

    code = "key_not_found"


@dataclass(frozen=True)
class AuthRecord:
    """What the gateway needs to know about a valid key. Quotas: None = unlimited.

    `rpm` / `tpm` are what applies to this key's requests (the stricter of the tenant's and the
    key's own); the gateway counts the tenant's on the tenant and the key's own on the key."""

    tenant_id: int
    tenant_name: str
    key_id: int
    key_prefix: str
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    monthly_token_budget: int | None
    expires_at: datetime | None
    tenant_rpm: int | None = None
    tenant_tpm: int | None = None
    key_rpm: int | None = None
    key_tpm: int | None = None
    weight: float = 1.0  # the tenant's scheduling weight, sent with each of its requests to the worker


def create_key(
    session: Session, tenant_name: str, *, name: str | None = None, expires_at: datetime | None = None,
    rpm: int | None = None, tpm: int | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for a tenant. Returns the row and the plaintext key, which is not stored anywhere.

    `rpm`/`tpm` tighten the tenant's quotas for this key (None = the tenant's value applies).
    """
    if name is not None and len(name) > KEY_NAME_MAX_LENGTH:
        raise InvalidQuotaError(f"key name is longer than {KEY_NAME_MAX_LENGTH} characters", field="name")
    check_aware("expires_at", expires_at)
    tenant = get_tenant(session, tenant_name)
    return _new_key(session, tenant, name=name, expires_at=expires_at,
                    rpm=check_quota("rpm", rpm), tpm=check_quota("tpm", tpm))


def _new_key(
    session: Session, tenant: Tenant, *, name: str | None, expires_at: datetime | None,
    rpm: int | None, tpm: int | None,
) -> tuple[ApiKey, str]:
    plaintext = generate_api_key()
    key = ApiKey(tenant=tenant, name=name, key_hash=hash_api_key(plaintext), prefix=display_prefix(plaintext),
                 expires_at=expires_at, rpm=rpm, tpm=tpm)
    session.add(key)
    session.flush()
    return key, plaintext


def list_keys(session: Session, tenant_name: str | None = None) -> list[ApiKey]:
    """Every key (of one tenant if given), oldest first. Raises TenantNotFoundError for an unknown tenant."""
    query = select(ApiKey).order_by(ApiKey.id)
    if tenant_name is not None:
        query = query.where(ApiKey.tenant_id == get_tenant(session, tenant_name).id)
    return list(session.scalars(query))


def _get_key(session: Session, key_id: int) -> ApiKey:
    key = session.get(ApiKey, key_id)
    if key is None:
        raise KeyNotFoundError(f"no API key with id {key_id}")
    return key


def revoke_key(session: Session, key_id: int) -> ApiKey:
    """Revoke a key now; revoking a revoked key keeps its first revocation time."""
    key = _get_key(session, key_id)
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


def rotate_key(session: Session, key_id: int, grace_seconds: int) -> tuple[ApiKey, str]:
    """Replace a key: a new key (same tenant, name, quotas and expiry) and the old one expires soon.

    The old key keeps working for `grace_seconds` (or until its own expiry, if sooner), so clients
    can switch without downtime. Returns the new row and its plaintext.
    """
    if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, int) or grace_seconds < 0:
        raise InvalidQuotaError(f"grace_seconds must be 0 or more, got {grace_seconds!r}", field="grace_seconds")
    old = _get_key(session, key_id)
    now = utcnow()
    if old.revoked_at is not None:
        raise AccountingError(f"API key {key_id} is revoked; create a new key instead")
    original_expiry = old.expires_at
    if original_expiry is not None and original_expiry <= now:
        raise AccountingError(f"API key {key_id} has expired; create a new key instead")
    grace_end = now + timedelta(seconds=grace_seconds)
    old.expires_at = grace_end if original_expiry is None else min(original_expiry, grace_end)
    return _new_key(session, old.tenant, name=old.name, expires_at=original_expiry, rpm=old.rpm, tpm=old.tpm)


def _stricter(tenant_value: int | None, key_value: int | None) -> int | None:
    if key_value is None:
        return tenant_value
    return key_value if tenant_value is None else min(tenant_value, key_value)


def authenticate(session: Session, key_hash: str, now: datetime | None = None) -> AuthRecord | None:
    """The AuthRecord of a usable key, else None (unknown, revoked, expired, or tenant disabled).

    One query. Per-key rpm/tpm apply where stricter than the tenant's (counted on the key, within
    the tenant's own limits). The caller compares hashes
    in constant time and caches the result.
    """
    if not isinstance(key_hash, str) or _KEY_HASH.fullmatch(key_hash) is None:
        return None
    now = check_aware("now", now) or utcnow()
    row = session.execute(
        select(ApiKey.id, ApiKey.prefix, ApiKey.expires_at, ApiKey.rpm, ApiKey.tpm,
               Tenant.id, Tenant.name, Tenant.rpm, Tenant.tpm, Tenant.max_concurrent,
               Tenant.monthly_token_budget, Tenant.weight)
        .join(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None), Tenant.disabled.is_(False),
               or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now))
    ).first()
    if row is None:
        return None
    key_id, prefix, expires_at, key_rpm, key_tpm, tenant_id, tenant_name, rpm, tpm, concurrent, budget, weight = row
    return AuthRecord(tenant_id=tenant_id, tenant_name=tenant_name, key_id=key_id, key_prefix=prefix,
                      rpm=_stricter(rpm, key_rpm), tpm=_stricter(tpm, key_tpm), max_concurrent=concurrent,
                      monthly_token_budget=budget, expires_at=expires_at, tenant_rpm=rpm, tenant_tpm=tpm,
                      key_rpm=key_rpm, key_tpm=key_tpm, weight=weight)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def key_status(key: ApiKey, now: datetime | None = None) -> str:
    """"revoked", "expired" or "active"."""
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and key.expires_at <= (now or utcnow()):
        return "expired"
    return "active"


def key_to_dict(key: ApiKey) -> dict[str, Any]:
    """A key as JSON-ready data (admin API); never the hash or the key itself."""
    return {
        "id": key.id, "tenant_id": key.tenant_id, "tenant": key.tenant.name, "name": key.name,
        "prefix": key.prefix, "status": key_status(key), "rpm": key.rpm, "tpm": key.tpm,
        "created_at": _iso(key.created_at), "expires_at": _iso(key.expires_at),
        "revoked_at": _iso(key.revoked_at),
    }
