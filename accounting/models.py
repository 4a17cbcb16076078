"""ORM models of the accounting database.

The schema is created and changed only by the Alembic migrations in `migrations/versions`; these
classes must stay in step with them (tests/integration/test_migrations.py compares the two).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
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
    __table_args__ = (*_non_negative(*QUOTA_FIELDS), CheckConstraint("weight > 0", name="weight_positive"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(TENANT_NAME_MAX_LENGTH), unique=True, nullable=False)
    disabled: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    rpm: Mapped[int | None] = mapped_column(BigInteger)
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent: Mapped[int | None] = mapped_column(BigInteger)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    # share of an engine's service when tenants contend (workers/engine/fairness.py): 2 gets twice 1's
    weight: Mapped[float] = mapped_column(Float, nullable=False, default=1.0, server_default=text("1"))
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
    rpm: Mapped[int | None] = mapped_column(BigInteger)
    tpm: Mapped[int | None] = mapped_column(BigInteger)

    # Always loaded with the key: serialisers and the CLI need the tenant name after the session ends.
    tenant: Mapped[Tenant] = relationship(back_populates="keys", lazy="joined")

    def __repr__(self) -> str:
        return f"ApiKey(id={self.id!r}, tenant_id={self.tenant_id!r}, prefix={self.prefix!r})"


MONEY = Numeric(18, 6)
"""Prices per 1M tokens, in the operator's currency (exact decimals, never floats)."""


class UsageEvent(Base):
    """Exactly one row per served request (request_id is unique): what it used and how it went."""

    __tablename__ = "usage_events"
    __table_args__ = (
        Index("ix_usage_events_tenant_finished", "tenant_id", "finished_at"),
        *(CheckConstraint(f"{c} >= 0", name=f"{c}_non_negative")
          for c in ("prompt_tokens", "cached_tokens", "completion_tokens")),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), nullable=False)
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(200), nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    status: Mapped[str] = mapped_column(String(32), nullable=False)
    """ok | client_disconnected | upstream_error | gateway_lost (billed from a worker's ledger after the
    gateway that carried it died) | rejected (tokens used before a failure are billed)."""
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    batch_id: Mapped[str | None] = mapped_column(String(64), index=True)
    route: Mapped[str | None] = mapped_column(String(32))
    """chat.completions | completions | responses; NULL on rows written before migration 0005."""


class Price(Base):
    """A model's prices per 1M tokens over [effective_from, effective_to); None = open-ended."""

    __tablename__ = "prices"
    __table_args__ = (
        Index("ix_prices_model_from", "model", "effective_from"),
        CheckConstraint("batch_discount >= 0 AND batch_discount <= 1", name="batch_discount_fraction"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(200), nullable=False)
    input_per_mtok: Mapped[Decimal] = mapped_column(MONEY, nullable=False)
    cached_input_per_mtok: Mapped[Decimal] = mapped_column(MONEY, nullable=False)
    output_per_mtok: Mapped[Decimal] = mapped_column(MONEY, nullable=False)
    batch_discount: Mapped[Decimal] = mapped_column(Numeric(5, 4), nullable=False, default=Decimal(0))
    """Fraction taken off batch requests' cost (0.5 = half price)."""
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    effective_to: Mapped[datetime | None] = mapped_column(UTCDateTime)


class IdempotentResponse(Base):
    """The response to a request sent with an Idempotency-Key, replayed when the key is used again.

    `body` is None while the first request is still running (a concurrent retry gets a 409).
    """

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("tenant_id", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), nullable=False)
    key: Mapped[str] = mapped_column(String(255), nullable=False)
    request_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    request_id: Mapped[str] = mapped_column(String(64), nullable=False)
    status_code: Mapped[int | None] = mapped_column(Integer)
    content_type: Mapped[str | None] = mapped_column(String(100))
    body: Mapped[bytes | None] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)


class File(Base):
    """An uploaded or generated file; its bytes live in the file store under `storage_key`."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "file-…"
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), nullable=False)
    filename: Mapped[str] = mapped_column(String(255), nullable=False)
    purpose: Mapped[str] = mapped_column(String(32), nullable=False)  # batch | batch_output | batch_errors
    bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    storage_key: Mapped[str] = mapped_column(String(255), nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Batch(Base):
    """An OpenAI-style batch job (states and transitions: `accounting.batches`)."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_tenant_created", "tenant_id", "created_at"),
                      Index("ix_batches_status", "status"))

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "batch_…"
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), nullable=False)
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    endpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"), nullable=False)
    output_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    error_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    completion_window: Mapped[str] = mapped_column(String(16), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    metadata_json: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors_json: Mapped[list[dict[str, Any]] | None] = mapped_column("errors", JSON)
    total: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completed: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    failed: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    estimated_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    """Prompt + max_tokens estimate of all lines: counts against the tenant's queued batch tokens."""
    runner_id: Mapped[str | None] = mapped_column(String(64))
    """The batch runner holding the lease (only it moves the batch on); None = unclaimed."""
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """When a run task was last queued for it (the sweep re-queues stalled batches)."""


class BatchResult(Base):
    """The outcome of one input line of a batch; at most one per line (UNIQUE(batch_id, line)).

    `status_code` is the gateway's HTTP status (200 = completed, anything else failed) with the
    response `body`; a line that never got an HTTP answer (expired, cancelled) has `error_code`.
    """

    __tablename__ = "batch_results"
    __table_args__ = (
        UniqueConstraint("batch_id", "line"),
        *(CheckConstraint(f"{c} >= 0", name=f"{c}_non_negative")
          for c in ("prompt_tokens", "cached_tokens", "completion_tokens")),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), nullable=False)
    line: Mapped[int] = mapped_column(Integer, nullable=False)
    custom_id: Mapped[str] = mapped_column(Text, nullable=False)
    request_id: Mapped[str | None] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(Integer)
    body: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)


class DashboardSession(Base):
    """A browser's session on /admin/dashboard (accounting/dashboard_sessions.py): the SHA-256 of its
    random token (never the token), when it ends, and the fingerprint of the admin key it was opened
    with (a changed admin key ends it)."""

    __tablename__ = "dashboard_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    admin_key_fingerprint: Mapped[str] = mapped_column(String(64), nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, index=True)
