"""Tenant administration, and what every accounting service shares: its errors and input checks.

Every function works on a caller-owned `Session`: it flushes (so ids and constraint errors show up
at once) but never commits or rolls back. Invalid input raises a subclass of `AccountingError`
(a `ValueError`) with a message fit for an operator. A tenant's API keys and key authentication
are `accounting.api_keys`.
"""

from __future__ import annotations

import enum
import math
import re
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from accounting.models import QUOTA_FIELDS, TENANT_NAME_MAX_LENGTH, Tenant

_TENANT_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{TENANT_NAME_MAX_LENGTH}}}")


class AccountingError(ValueError):
    """Base of every error caused by bad input to the accounting services; `field` names the input at fault."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotFoundError(AccountingError):
    """The thing asked for does not exist (for the caller); `code` names what it was."""

    code = "not_found"


class TenantNotFoundError(NotFoundError):
    """No tenant has that name."""

    code = "tenant_not_found"


class TenantExistsError(AccountingError):
    """A tenant with that name exists already."""


class InvalidQuotaError(AccountingError):
    """A quota (or name, or other value) is out of range."""


class _Unlimited(enum.Enum):
    UNLIMITED = "unlimited"


UNLIMITED = _Unlimited.UNLIMITED
"""Pass as a quota to `update_tenant` to remove the limit (store None); None there means "no change"."""
Unlimited = Literal[_Unlimited.UNLIMITED]
QuotaUpdate = int | Unlimited | None


MAX_QUOTA = 2**63 - 1
"""Quotas are BIGINT columns."""
MAX_WEIGHT = 1000.0
"""The largest scheduling weight: a tenant may get at most that many times a weight-1 tenant's service."""


def check_quota(field: str, value: object) -> int | None:
    """A quota (None: unlimited) checked: a whole number in [0, MAX_QUOTA]; InvalidQuotaError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidQuotaError(f"{field} must be a whole number or unlimited, got {value!r}", field=field)
    if not 0 <= value <= MAX_QUOTA:
        raise InvalidQuotaError(f"{field} must be between 0 and {MAX_QUOTA}, got {value}", field=field)
    return value


def check_weight(value: object) -> float:
    """A tenant's scheduling weight: a number in (0, MAX_WEIGHT]; InvalidQuotaError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidQuotaError(f"weight must be a number, got {value!r}", field="weight")
    if not 0 < value <= MAX_WEIGHT:
        raise InvalidQuotaError(f"weight must be above 0 and at most {MAX_WEIGHT:g}, got {value}", field="weight")
    return float(value)


def check_tenant_name(name: object) -> str:
    if not isinstance(name, str) or _TENANT_NAME.fullmatch(name) is None:
        raise InvalidQuotaError(
            f"invalid tenant name {name!r}: use 1-{TENANT_NAME_MAX_LENGTH} letters, digits, '-', '_' or '.'",
            field="name")
    return name


def check_aware(field: str, value: datetime | None) -> datetime | None:
    """`value` (None passes) if it is timezone-aware; InvalidQuotaError otherwise."""
    if value is not None and value.tzinfo is None:
        raise InvalidQuotaError(f"{field} must be timezone-aware (UTC), got a naive datetime", field=field)
    return value


def create_tenant(
    session: Session, name: str, *, rpm: int | None = None, tpm: int | None = None,
    max_concurrent: int | None = None, monthly_token_budget: int | None = None, weight: float = 1.0,
) -> Tenant:
    """Create a tenant; quotas left at None are unlimited; `weight` is its scheduling weight."""
    check_tenant_name(name)
    quotas = {"rpm": rpm, "tpm": tpm, "max_concurrent": max_concurrent,
              "monthly_token_budget": monthly_token_budget}
    checked = {field: check_quota(field, value) for field, value in quotas.items()}
    weight = check_weight(weight)
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise TenantExistsError(f"tenant {name!r} exists already")
    tenant = Tenant(name=name, disabled=False, weight=weight, **checked)
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError as error:  # created concurrently since the check above
        raise TenantExistsError(f"tenant {name!r} exists already") from error
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    """Every tenant, by name."""
    return list(session.scalars(select(Tenant).order_by(Tenant.name)))


def get_tenant(session: Session, name: str) -> Tenant:
    """The tenant called `name`; raises TenantNotFoundError."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise TenantNotFoundError(f"no tenant named {name!r}")
    return tenant


def update_tenant(
    session: Session, name: str, *, rpm: QuotaUpdate = None, tpm: QuotaUpdate = None,
    max_concurrent: QuotaUpdate = None, monthly_token_budget: QuotaUpdate = None,
    disabled: bool | None = None, weight: float | None = None,
) -> Tenant:
    """Change some quotas (or `disabled`, or the scheduling `weight`) of a tenant.

    For each quota: None leaves it unchanged, an int sets it, `UNLIMITED` removes the limit.
    """
    updates: dict[str, Any] = {"rpm": rpm, "tpm": tpm, "max_concurrent": max_concurrent,
                               "monthly_token_budget": monthly_token_budget}
    tenant = get_tenant(session, name)
    checked: dict[str, int | None] = {}
    for field, value in updates.items():
        if value is UNLIMITED:
            checked[field] = None
        elif value is not None:
            checked[field] = check_quota(field, value)
    new_weight = None if weight is None else check_weight(weight)
    for field, value in checked.items():
        setattr(tenant, field, value)
    if new_weight is not None:
        tenant.weight = new_weight
    if disabled is not None:
        tenant.disabled = bool(disabled)
    session.flush()
    return tenant


def set_tenant_disabled(session: Session, name: str, disabled: bool) -> Tenant:
    """Disable (every key stops authenticating) or re-enable a tenant."""
    tenant = get_tenant(session, name)
    tenant.disabled = disabled
    session.flush()
    return tenant


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def tenant_to_dict(tenant: Tenant) -> dict[str, Any]:
    """A tenant as JSON-ready data (admin API)."""
    data: dict[str, Any] = {"id": tenant.id, "name": tenant.name, "disabled": tenant.disabled}
    data.update({field: getattr(tenant, field) for field in QUOTA_FIELDS})
    data["weight"] = tenant.weight
    data.update(created_at=_iso(tenant.created_at), updated_at=_iso(tenant.updated_at))
    return data
