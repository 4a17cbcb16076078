"""UsageWriter on PostgreSQL (a fresh schema per test): one row per request_id under concurrency."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.exc import DataError, IntegrityError

from accounting.db import session_factory, upgrade_database
from accounting.models import UsageEvent
from accounting.tenants import create_tenant
from accounting.usage import FIELD_NAMES, UsageRecord
from accounting.usage_writer import UsageWriter

pytestmark = pytest.mark.services

T0 = datetime(2026, 3, 4, 5, 6, 7, 891_000, tzinfo=UTC)


@pytest.fixture
def engine(postgres_schema: tuple[str, str]) -> Iterator[Engine]:
    """A migrated database in a fresh schema, holding tenant 'acme'."""
    url, _ = postgres_schema
    engine = create_engine(url, pool_pre_ping=True)
    try:
        upgrade_database(engine)
        with session_factory(engine).begin() as session:
            create_tenant(session, "acme")
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def writer(engine: Engine, tmp_path: Path) -> Iterator[UsageWriter]:
    writer = UsageWriter(engine, spool_path=tmp_path / "usage.jsonl")
    writer.start()
    yield writer
    writer.close(timeout=30)


def tenant_id(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(text("SELECT id FROM tenants WHERE name = 'acme'")))


def record(tenant: int, request_id: str, n: int) -> UsageRecord:
    return UsageRecord(
        request_id=request_id, tenant_id=tenant, model="smollm2-135m-instruct", prompt_tokens=n,
        cached_tokens=n % 16, completion_tokens=n % 31, status="ok", finish_reason="stop", ttft_ms=9.5,
        latency_ms=120.0, started_at=T0 + timedelta(milliseconds=n), finished_at=T0 + timedelta(seconds=1, milliseconds=n),
    )


def rows_by_request(engine: Engine) -> dict[str, int]:
    with engine.connect() as connection:
        result = connection.execute(select(UsageEvent.request_id, func.count()).group_by(UsageEvent.request_id))
        return {request_id: int(n) for request_id, n in result}


@pytest.mark.asyncio
async def test_concurrent_writes_make_exactly_one_row_each(engine: Engine, writer: UsageWriter) -> None:
    tenant = tenant_id(engine)
    records = [record(tenant, f"req-{n}", n) for n in range(2000)]
    await asyncio.gather(*(writer.write(r) for r in records))
    assert rows_by_request(engine) == {r.request_id: 1 for r in records}
    stats = writer.stats()
    assert stats.rows_written == 2000 and stats.rows_spooled == 0 and stats.transactions < 2000
    with session_factory(engine)() as session:
        row = session.scalars(select(UsageEvent).where(UsageEvent.request_id == "req-1234")).one()
        assert (row.prompt_tokens, row.finished_at) == (1234, records[1234].finished_at)
        assert row.finished_at.tzinfo is not None


@pytest.mark.asyncio
async def test_a_duplicate_storm_makes_one_row_per_request_id(engine: Engine, writer: UsageWriter) -> None:
    tenant = tenant_id(engine)
    writes = [record(tenant, f"dup-{n % 250}", n) for n in range(2000)]  # each request_id 8 times
    random.Random(7).shuffle(writes)
    await asyncio.gather(*(writer.write(r) for r in writes))
    await asyncio.gather(*(writer.write(r) for r in writes[:500]))  # later retries
    assert rows_by_request(engine) == {f"dup-{n}": 1 for n in range(250)}


@pytest.mark.asyncio
async def test_a_bad_record_fails_alone(engine: Engine, writer: UsageWriter) -> None:
    tenant = tenant_id(engine)
    too_long = record(tenant, "req-long", 1)
    object.__setattr__(too_long, "model", "m" * 300)  # slips past the record's own checks
    writes = [record(tenant, f"req-{n}", n) for n in range(50)]
    writes += [too_long, record(tenant + 1000, "req-no-tenant", 2)]
    results = await asyncio.gather(*(writer.write(r) for r in writes), return_exceptions=True)
    assert isinstance(results[-2], DataError) and isinstance(results[-1], IntegrityError)
    assert results[:-2] == [None] * 50
    assert set(rows_by_request(engine)) == {f"req-{n}" for n in range(50)}


@pytest.mark.asyncio
async def test_a_dropped_connection_spools_and_replays(postgres_schema: tuple[str, str], engine: Engine,
                                                       tmp_path: Path) -> None:
    url, _ = postgres_schema
    tenant = tenant_id(engine)
    application = f"tollway-usage-test-{uuid.uuid4().hex[:8]}"
    # No pre-ping: the writer's pooled connection dies under it, as in a database restart.
    bare = create_engine(url, connect_args={"application_name": application})
    writer = UsageWriter(bare, spool_path=tmp_path / "usage.jsonl", replay_interval_s=0.1)
    writer.start()
    try:
        await writer.write(record(tenant, "before", 0))
        with engine.connect() as connection:
            killed = connection.scalar(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = :a"),
                {"a": application})
        assert killed == 1
        records = [record(tenant, f"after-{n}", n) for n in range(100)]
        await asyncio.gather(*(writer.write(r) for r in records))
    finally:
        writer.close(timeout=30)
        bare.dispose()
    assert writer.stats().rows_spooled > 0
    assert rows_by_request(engine) == {"before": 1, **{r.request_id: 1 for r in records}}
    assert (tmp_path / "usage.jsonl").stat().st_size == 0


@pytest.mark.asyncio
async def test_every_field_round_trips_through_copy(engine: Engine, writer: UsageWriter) -> None:
    tenant = tenant_id(engine)
    odd = UsageRecord(
        request_id="req\\odd\t1", tenant_id=tenant, key_id=None, model="we\nird\r\\model é 模型",
        prompt_tokens=0, cached_tokens=0, completion_tokens=2**31 - 1, status="upstream_error",
        finish_reason="\\N", ttft_ms=0.1 + 0.2, latency_ms=None, started_at=T0,
        finished_at=T0 + timedelta(microseconds=1), batch_id="batch_\t",
    )
    plain = record(tenant, "req-plain", 5)
    await asyncio.gather(writer.write(odd), writer.write(plain))
    with session_factory(engine)() as session:
        rows = {row.request_id: UsageRecord(**{name: getattr(row, name) for name in FIELD_NAMES})
                for row in session.scalars(select(UsageEvent))}
    assert rows == {odd.request_id: odd, plain.request_id: plain}


def test_rows_are_never_committed_inline_on_postgresql(engine: Engine, writer: UsageWriter) -> None:
    """try_write_now is for SQLite's local commit: a server's round trips (or a stuck server) must not
    block the caller's event loop, so PostgreSQL rows always go to the writer thread."""
    tenant = tenant_id(engine)
    assert not writer.try_write_now(record(tenant, "req-inline", 1))
    writer.submit(record(tenant, "req-inline", 1)).result(timeout=30)
    with engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(UsageEvent)) == 1
