"""ORM models of the accounting database.

The schema is created and changed only by the Alembic migrations in `migrations/versions`; these
classes must stay in step with them (tests/integration/test_migrations.py compares the two).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    ForeignKey,
    Integer,
    MetaData,
    String,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Deterministic constraint names: Alembic (and SQLite batch mode) can only drop what has a name.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TENANT_NAME_MAX_LENGTH = 64
QUOTA_FIELDS = ("rpm", "tpm", "max_concurrent", "monthly_token_budget")
"""Tenant quota columns; None means unlimited."""
KEY_QUOTA_FIELDS = ("rpm", "tpm")
"""Quota columns a key may override; None means the tenant's value applies."""


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python.

    SQLite has no time zone support, so values are stored there as naive UTC; PostgreSQL keeps a
    `timestamp with time zone`. Naive datetimes are rejected so local time never sneaks in.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; use a timezone-aware datetime (UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base of every accounting table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _non_negative(*columns: str) -> tuple[CheckConstraint, ...]:
    return tuple(CheckConstraint(f"{c} IS NULL OR {c} >= 0", name=f"{c}_non_negative") for c in columns)


class Tenant(Base):
    """A customer: quotas (None = unlimited) apply to all of its keys."""

    __tablename__ = "tenants"
    __table_args__ = _non_negative(*QUOTA_FIELDS)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(TENANT_NAME_MAX_LENGTH), unique=True, nullable=False)
    disabled: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow, onupdate=utcnow)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")

    def __repr__(self) -> str:
        return f"Tenant(id={self.id!r}, name={self.name!r}, disabled={self.disabled!r})"


class ApiKey(Base):
    """An API key of a tenant. Only the SHA-256 of the key is stored, never the key itself."""

    __tablename__ = "api_keys"
    __table_args__ = _non_negative(*KEY_QUOTA_FIELDS)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), nullable=False, index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True, index=True)
    prefix: Mapped[str] = mapped_column(String(16), nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)

    # Always loaded with the key: serialisers and the CLI need the tenant name after the session ends.
    tenant: Mapped[Tenant] = relationship(back_populates="keys", lazy="joined")

    def __repr__(self) -> str:
        return f"ApiKey(id={self.id!r}, tenant_id={self.tenant_id!r}, prefix={self.prefix!r})"
