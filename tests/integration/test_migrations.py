"""The Alembic migrations: up, down and up again, and in step with accounting.models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, inspect

from accounting.db import create_db_engine, current_revision, downgrade_database, upgrade_database
from accounting.models import Base

EXPECTED_COLUMNS = {
    "tenants": {"id", "name", "disabled", "rpm", "tpm", "max_concurrent", "monthly_token_budget", "weight",
                "created_at", "updated_at"},
    "api_keys": {"id", "tenant_id", "name", "key_hash", "prefix", "created_at", "revoked_at", "expires_at",
                 "rpm", "tpm"},
    "usage_events": {"id", "request_id", "tenant_id", "key_id", "model", "prompt_tokens", "cached_tokens",
                     "completion_tokens", "status", "finish_reason", "ttft_ms", "latency_ms", "started_at",
                     "finished_at", "batch_id", "route"},
    "prices": {"id", "model", "input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "batch_discount",
               "effective_from", "effective_to"},
    "idempotency_keys": {"id", "tenant_id", "key", "request_hash", "request_id", "status_code", "content_type",
                         "body", "created_at"},
    "files": {"id", "tenant_id", "filename", "purpose", "bytes", "storage_key", "created_at", "deleted_at"},
    "batches": {"id", "tenant_id", "key_id", "endpoint", "input_file_id", "output_file_id", "error_file_id",
                "completion_window", "status", "metadata", "errors", "total", "completed", "failed", "created_at",
                "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                "cancelling_at", "cancelled_at", "estimated_tokens", "runner_id", "lease_until", "dispatched_at"},
    "batch_results": {"id", "batch_id", "line", "custom_id", "request_id", "status_code", "body", "error_code",
                      "error_message", "prompt_tokens", "cached_tokens", "completion_tokens", "created_at"},
    "dashboard_sessions": {"token_hash", "admin_key_fingerprint", "created_at", "expires_at"},
}


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'tollway.db'}")
    yield engine
    engine.dispose()


@pytest.fixture
def postgres_engine(postgres_schema: tuple[str, str]) -> Iterator[Engine]:
    """An engine whose connections live in a fresh schema (other tests share the database)."""
    engine = create_engine(postgres_schema[0], pool_pre_ping=True)
    yield engine
    engine.dispose()


def assert_schema_at_head(engine: Engine) -> None:
    assert current_revision(engine) is not None
    inspector = inspect(engine)
    tables = set(inspector.get_table_names())
    assert set(EXPECTED_COLUMNS) <= tables
    for table, columns in EXPECTED_COLUMNS.items():
        assert {c["name"] for c in inspector.get_columns(table)} == columns
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def assert_schema_empty(engine: Engine) -> None:
    assert current_revision(engine) is None
    assert not set(EXPECTED_COLUMNS) & set(inspect(engine).get_table_names())


def up_down_up(engine: Engine) -> None:
    assert_schema_empty(engine)
    upgrade_database(engine)
    assert_schema_at_head(engine)
    downgrade_database(engine)
    assert_schema_empty(engine)
    upgrade_database(engine)
    assert_schema_at_head(engine)


def test_migrations_on_sqlite(sqlite_engine: Engine) -> None:
    up_down_up(sqlite_engine)


def test_migrations_on_sqlite_by_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'by-url.db'}"
    upgrade_database(url)
    engine = create_db_engine(url)
    try:
        assert_schema_at_head(engine)
        downgrade_database(url)
        assert_schema_empty(engine)
    finally:
        engine.dispose()


@pytest.mark.services
def test_migrations_on_postgresql(postgres_engine: Engine) -> None:
    up_down_up(postgres_engine)


@pytest.mark.services
def test_replicas_migrating_at_once_serialise(postgres_schema: tuple[str, str]) -> None:
    """Several gateways starting together on a fresh PostgreSQL database all migrate it safely."""
    from concurrent.futures import ThreadPoolExecutor

    engines = [create_engine(postgres_schema[0]) for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(upgrade_database, engines))  # raises if two ran the DDL together
        assert_schema_at_head(engines[0])
    finally:
        for engine in engines:
            engine.dispose()
