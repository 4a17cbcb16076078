"""UsageWriter on a migrated SQLite file: group commit, one row per request_id, the spool."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import fields
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, func, insert, select
from sqlalchemy.exc import IntegrityError, OperationalError

from accounting import usage_commit, usage_connection, usage_writer
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.models import IdempotentResponse, UsageEvent
from accounting.tenants import create_tenant
from accounting.usage import FIELD_NAMES, UsageRecord
from accounting.usage_commit import StoredResponse, insert_records
from accounting.usage_writer import UsageWriter

T0 = datetime(2026, 1, 2, 3, 4, 5, 678_000, tzinfo=UTC)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'tollway.db'}"
    upgrade_database(url)
    engine = create_db_engine(url)
    with session_factory(engine).begin() as session:
        create_tenant(session, "acme")
    yield engine
    engine.dispose()


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool" / "usage.jsonl"


@pytest.fixture
def writers(engine: Engine, spool: Path) -> Iterator[Callable[..., UsageWriter]]:
    """Started writers on the test database, closed at the end of the test."""
    made: list[UsageWriter] = []

    def make(**options: Any) -> UsageWriter:
        writer = UsageWriter(engine, spool_path=spool, replay_interval_s=options.pop("replay_interval_s", 0.05),
                             **options)
        writer.start()
        made.append(writer)
        return writer

    yield make
    for writer in made:
        writer.close(timeout=10)


def record(n: int, **changes: Any) -> UsageRecord:
    values: dict[str, Any] = {
        "request_id": f"req-{n}", "tenant_id": 1, "key_id": None, "model": "smollm2-135m-instruct",
        "prompt_tokens": 100 + n, "cached_tokens": n % 64, "completion_tokens": 7 + n % 13, "status": "ok",
        "finish_reason": "stop", "ttft_ms": 12.5 + n, "latency_ms": 250.25 + n,
        "started_at": T0 + timedelta(seconds=n), "finished_at": T0 + timedelta(seconds=n, milliseconds=250),
        "batch_id": f"batch_{n % 3}" if n % 2 else None,
    }
    values.update(changes)
    return UsageRecord(**values)


def stored(engine: Engine) -> dict[str, UsageRecord]:
    """Every row of usage_events as a record, by request_id."""
    with session_factory(engine)() as session:
        rows = session.scalars(select(UsageEvent)).all()
        return {row.request_id: UsageRecord(**{name: getattr(row, name) for name in FIELD_NAMES}) for row in rows}


def count(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(select(func.count()).select_from(UsageEvent)) or 0)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)


def spool_lines(spool: Path) -> list[str]:
    return [line for line in spool.read_text().splitlines() if line.strip()]


class FlakyInsert:
    """Replaces a writer's insert step: raises OperationalError until `up` is set (counts calls)."""

    def __init__(self, writer: UsageWriter) -> None:
        self.insert = writer._insert
        self.up = threading.Event()
        self.failures = 0

    def __call__(self, records: list[UsageRecord]) -> None:
        if not self.up.is_set():
            self.failures += 1
            raise OperationalError("INSERT INTO usage_events", {}, Exception("database is down"))
        self.insert(records)


def test_the_record_has_exactly_the_columns_of_usage_events() -> None:
    columns = [c.name for c in UsageEvent.__table__.columns if c.name != "id"]
    assert list(FIELD_NAMES) == columns == [f.name for f in fields(UsageRecord)]


def test_records_are_checked_and_round_trip_through_json() -> None:
    r = record(5, started_at=datetime(2026, 1, 2, 5, 0, tzinfo=timezone(timedelta(hours=2))))
    assert r.started_at.tzinfo is UTC and r.started_at == datetime(2026, 1, 2, 3, 0, tzinfo=UTC)
    assert UsageRecord.from_json(r.to_json()) == r
    assert r.to_row()["request_id"] == "req-5" and set(r.to_row()) == set(FIELD_NAMES)
    for bad in ({"started_at": datetime(2026, 1, 1)}, {"prompt_tokens": -1}, {"request_id": ""},
                {"request_id": "x" * 65}, {"cached_tokens": 1.5}):
        with pytest.raises(ValueError):
            record(1, **bad)


@pytest.mark.asyncio
async def test_concurrent_writes_are_group_committed_and_round_trip(engine: Engine, writers) -> None:
    writer = writers()
    records = [record(n) for n in range(500)]
    await asyncio.gather(*(writer.write(r) for r in records))
    assert stored(engine) == {r.request_id: r for r in records}  # every field, times tz-aware UTC
    assert all(r.finished_at.tzinfo is not None for r in stored(engine).values())
    stats = writer.stats()
    assert stats.rows_written == 500 and stats.rows_spooled == 0
    assert stats.transactions <= 50  # batching: far fewer commits than rows


@pytest.mark.asyncio
async def test_a_request_id_written_twice_makes_one_row(engine: Engine, writers) -> None:
    writer = writers()
    await asyncio.gather(*(writer.write(record(n % 20)) for n in range(200)))  # concurrent duplicates
    await writer.write(record(3, completion_tokens=999))  # a later retry, even a different one
    rows = stored(engine)
    assert len(rows) == 20 and rows["req-3"] == record(3)


@pytest.mark.asyncio
async def test_a_bad_record_fails_alone(engine: Engine, writers) -> None:
    writer = writers(max_delay_s=0.05)
    results = await asyncio.gather(*(writer.write(record(n, tenant_id=99 if n == 7 else 1)) for n in range(20)),
                                   return_exceptions=True)
    assert isinstance(results[7], IntegrityError)  # unknown tenant: the caller is told
    assert [r for i, r in enumerate(results) if i != 7] == [None] * 19
    assert set(stored(engine)) == {f"req-{n}" for n in range(20) if n != 7}


@pytest.mark.asyncio
async def test_a_failed_commit_spools_and_the_replay_inserts_exactly_once(
        engine: Engine, spool: Path, writers) -> None:
    writer = writers()
    flaky = FlakyInsert(writer)
    writer._insert = flaky  # type: ignore[method-assign]
    records = [record(n) for n in range(100)]
    await asyncio.gather(*(writer.write(r) for r in records))  # resolved: durable in the spool
    wait_for(lambda: flaky.failures >= 3)  # the live commit, then replays, fail
    assert count(engine) == 0
    assert {UsageRecord.from_json(line) for line in spool_lines(spool)} == set(records)
    assert writer.stats().rows_spooled == 100

    flaky.up.set()  # the database is back: the next replay empties the spool
    wait_for(lambda: spool.stat().st_size == 0)
    assert stored(engine) == {r.request_id: r for r in records}
    assert writer.stats().rows_replayed == 100
    await asyncio.gather(*(writer.write(r) for r in records[:10]))  # retries change nothing
    assert count(engine) == 100


@pytest.mark.asyncio
async def test_a_failed_spool_write_fails_the_write(engine: Engine, writers) -> None:
    writer = writers()
    writer._insert = FlakyInsert(writer)  # type: ignore[method-assign]

    def no_disk(records: Any) -> None:
        raise OSError("no space left on device")

    writer._spool.append = no_disk  # type: ignore[method-assign]
    with pytest.raises(OSError, match="no space"):
        await writer.write(record(1))
    assert count(engine) == 0


@pytest.mark.asyncio
async def test_a_cancelled_write_is_still_written(engine: Engine, writers) -> None:
    writer = writers(max_delay_s=0.05)
    task = asyncio.ensure_future(writer.write(record(1)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    writer.close()
    assert set(stored(engine)) == {"req-1"}


def test_close_flushes_pending_rows(engine: Engine, spool: Path) -> None:
    writer = UsageWriter(engine, spool_path=spool, max_delay_s=0.5)
    writer.start()
    futures = [writer.submit(record(n)) for n in range(300)]
    writer.close(timeout=10)
    assert all(f.done() and f.exception() is None for f in futures)
    assert count(engine) == 300
    with pytest.raises(RuntimeError):
        writer.submit(record(1000))


def test_a_restarted_writer_replays_the_spool(engine: Engine, spool: Path) -> None:
    records = [record(n) for n in range(50)]
    spool.parent.mkdir(parents=True)
    # Left by a crashed process: one row already inserted before the crash, and a torn last line.
    spool.write_text("".join(r.to_json() + "\n" for r in records) + records[0].to_json()[:30])
    with session_factory(engine).begin() as session:
        session.add(UsageEvent(**records[0].to_row()))
    writer = UsageWriter(engine, spool_path=spool, replay_interval_s=0.05)
    writer.start()
    wait_for(lambda: spool.stat().st_size == 0)
    future = writer.submit(record(50))
    writer.close(timeout=10)
    future.result()
    assert stored(engine) == {r.request_id: r for r in [*records, record(50)]}
    assert writer.stats().rows_rejected == 1  # the torn line, kept aside
    assert spool.with_name(spool.name + ".rejected").read_text().strip() == records[0].to_json()[:30]


@pytest.mark.asyncio
async def test_a_large_spool_is_replayed_in_chunks_between_live_writes(engine: Engine, spool: Path) -> None:
    spooled = [record(n) for n in range(250)]
    spool.parent.mkdir(parents=True)
    spool.write_text("".join(r.to_json() + "\n" for r in spooled))
    writer = UsageWriter(engine, spool_path=spool, max_batch=100, replay_interval_s=0.05)
    writer.start()
    live = [record(n) for n in range(1000, 1100)]
    await asyncio.gather(*(writer.write(r) for r in live))
    wait_for(lambda: spool.stat().st_size == 0)
    writer.close(timeout=10)
    assert stored(engine) == {r.request_id: r for r in [*spooled, *live]}
    assert writer.stats().rows_replayed == 250 and writer.stats().rows_written == 100


def test_a_batch_larger_than_one_sqlite_statement_is_inserted_whole(engine: Engine) -> None:
    records = [record(n, started_at=T0.replace(microsecond=0), finished_at=T0.replace(microsecond=0))
               for n in range(usage_commit._SQLITE_ROWS_PER_INSERT * 2 + 5)]
    with engine.begin() as connection:
        insert_records(connection, records)
        insert_records(connection, records[:3])  # already there: skipped
    assert stored(engine) == {r.request_id: r for r in records}


def test_sqlite_rows_are_stored_as_sqlalchemy_stores_them(engine: Engine) -> None:
    """The driver-level insert writes the same column text as SQLAlchemy's own (times included, a
    whole second too), so rows read back alike whichever path wrote them."""
    on_the_second = T0.replace(microsecond=0)
    ours = record(1, started_at=on_the_second, finished_at=T0)
    theirs = record(2, started_at=on_the_second, finished_at=T0)
    with engine.begin() as connection:
        insert_records(connection, [ours])
        connection.execute(insert(UsageEvent), [theirs.to_row()])
        raw = {row[0]: row[1:] for row in connection.exec_driver_sql(
            "SELECT request_id, started_at, finished_at, ttft_ms, batch_id FROM usage_events")}
    assert raw["req-1"][:2] == raw["req-2"][:2] == ("2026-01-02 03:04:05.000000", "2026-01-02 03:04:05.678000")
    assert raw["req-1"][2:] == (13.5, "batch_1") and raw["req-2"][2:] == (14.5, None)


class Checkouts:
    """Counts the engine's pool checkouts (connections handed out) to the writer's thread."""

    def __init__(self, engine: Engine) -> None:
        self.count = 0
        event.listen(engine, "checkout", self._checkout)

    def _checkout(self, *_: Any) -> None:
        if threading.current_thread().name == "usage-writer":
            self.count += 1


@pytest.mark.asyncio
async def test_the_writer_keeps_its_connection_and_replaces_a_failed_or_idle_one(engine: Engine, writers,
                                                                                  monkeypatch) -> None:
    writer = writers()
    checkouts = Checkouts(engine)
    for n in range(5):
        await writer.write(record(n))
    assert checkouts.count == 1  # one connection for five batches

    failures = []

    def failing_once(connection: Any, records: list[UsageRecord]) -> None:
        if not failures:
            failures.append(1)
            raise OperationalError("INSERT INTO usage_events", {}, Exception("disk I/O error"))
        insert_records(connection, records)

    monkeypatch.setattr(usage_writer, "insert_records", failing_once)
    await writer.write(record(5))  # spooled, then replayed on a fresh connection
    wait_for(lambda: count(engine) == 6)
    assert checkouts.count == 2

    monkeypatch.setattr(usage_connection, "IDLE_S", 0.0)
    await writer.write(record(6))
    await writer.write(record(7))
    assert checkouts.count == 4  # each found the last one idle too long
    assert set(stored(engine)) == {f"req-{n}" for n in range(8)}


def test_an_idle_writer_lets_the_caller_commit_its_row_now(engine: Engine, writers) -> None:
    """try_write_now: committed on the calling thread (the writer thread's queue untouched), with its
    stored response in the same transaction; a row the database refuses raises as write() would."""
    writer = writers()
    with session_factory(engine).begin() as session:  # the request's claim of its Idempotency-Key
        session.add(IdempotentResponse(tenant_id=1, key="idem-1", request_hash="h", request_id="req-1"))
    committed_on: list[str] = []
    event.listen(engine, "commit", lambda _: committed_on.append(threading.current_thread().name))
    response = StoredResponse(1, "idem-1", 200, "application/json", b'{"ok": true}')
    assert writer.try_write_now(record(1), response)
    assert committed_on == [threading.current_thread().name] and writer._queue.empty()
    assert stored(engine) == {"req-1": record(1)} and writer.stats().rows_written == 1
    with session_factory(engine)() as session:
        assert session.scalars(select(IdempotentResponse.body)).one() == b'{"ok": true}'
    assert writer.try_write_now(record(1, completion_tokens=999))  # a retry: still one row, the first
    assert stored(engine)["req-1"] == record(1)
    with pytest.raises(IntegrityError):  # unknown tenant
        writer.try_write_now(record(2, tenant_id=99))
    assert count(engine) == 1


def test_a_busy_or_failing_database_leaves_the_row_to_write(engine: Engine, spool: Path, writers) -> None:
    """False, having written nothing, while the writer thread holds the connection, after the database
    failed (write() then spools the row) or once the writer is closed."""
    writer = writers()
    with writer._kept.lock:  # the writer thread in a batch
        assert not writer.try_write_now(record(1))
    assert count(engine) == 0
    flaky = FlakyInsert(writer)
    writer._insert = flaky  # type: ignore[method-assign]
    assert not writer.try_write_now(record(2)) and flaky.failures == 1
    writer.submit(record(2)).result(timeout=10)  # the fallback: spooled by the writer thread
    assert not writer.try_write_now(record(3))  # the database is marked down: straight to write()
    assert flaky.failures == 2 and [UsageRecord.from_json(line) for line in spool_lines(spool)] == [record(2)]
    flaky.up.set()
    wait_for(lambda: count(engine) == 1)  # replayed
    writer.close(timeout=10)
    assert not writer.try_write_now(record(4))


def test_a_database_another_process_is_writing_is_not_waited_for_inline(engine: Engine, tmp_path: Path,
                                                                        writers) -> None:
    """SQLite locked by another writer: try_write_now gives up at once (the caller's event loop must not
    wait out the busy timeout) and leaves the row to write(); the writer thread's batches wait again."""
    writer = writers()
    assert writer.try_write_now(record(1))  # the kept connection exists
    other = sqlite3.connect(tmp_path / "tollway.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # holds the write lock
    started = time.perf_counter()
    assert not writer.try_write_now(record(2))
    assert time.perf_counter() - started < 1.0  # the driver's busy timeout is 5 s
    other.execute("ROLLBACK")
    other.close()
    assert writer.try_write_now(record(3))
    assert busy_timeout_ms(writer) == 0  # inline commits set it once, not twice each
    other = sqlite3.connect(tmp_path / "tollway.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    waiting = writer.submit(record(2))  # the writer thread's batch waits for the lock, not spools the row
    time.sleep(0.3)
    other.execute("ROLLBACK")
    other.close()
    waiting.result(timeout=10)
    assert set(stored(engine)) == {"req-1", "req-2", "req-3"}
    assert busy_timeout_ms(writer) == 5000


def busy_timeout_ms(writer: UsageWriter) -> int:
    with writer._kept.lock:
        driver = writer._kept.get(time.perf_counter()).connection.driver_connection
        return int(driver.execute("PRAGMA busy_timeout").fetchone()[0])
