"""Group-committed metering: one usage row per request, durable before the caller goes on.

The gateway awaits `UsageWriter.write(record)` before it sends a response's last byte. One writer
thread owns every database write: it takes the first queued record, gathers whatever else arrives
within `max_delay_s` (at most `max_batch` records) and inserts them all in ONE transaction with
`accounting.usage_commit.insert_records` (ON CONFLICT (request_id) DO NOTHING, so a retried
request_id never makes a second row; multi-row, or COPY on PostgreSQL). A single writer is what
SQLite in WAL mode wants, and it keeps PostgreSQL at one commit per batch instead of one per request.
A caller with nothing else in flight may instead commit its own row on its thread while the writer
thread is idle (`try_write_now`: the same transaction, on the same kept connection, under its lock).

Durability when the database fails: the batch is appended to a local spool file (JSON lines,
fsync'd, `accounting.usage_spool`) and the callers are told it is durable. Invariant: an
acknowledged row is in the database or in the spool (possibly both), never neither. The spool is
replayed into the database by `accounting.usage_replay` (its docstring tells how). If even the
spool write fails, the callers' futures get the exception. Callers are told how their writes went
by `accounting.usage_waiters`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias

from sqlalchemy import Engine
from sqlalchemy.exc import DataError, IntegrityError

from accounting.usage import UsageRecord
from accounting.usage_commit import SUPPORTED_DIALECTS, StoredResponse, insert_records, store_responses
from accounting.usage_connection import KeptConnection
from accounting.usage_replay import SpoolReplay
from accounting.usage_spool import UsageSpool, read_spooled
from accounting.usage_waiters import Waiter, settle

log = logging.getLogger(__name__)

_STOP = object()
"""Queued by close(); everything submitted before it is written first (FIFO)."""

_Item: TypeAlias = tuple[UsageRecord, Waiter]
"""A queued record and who waits for it: submit()'s future, or write()'s future on its event loop."""
_BAD_ROW_ERRORS = (IntegrityError, DataError)
"""Errors that condemn a row, not the database: retrying cannot help, so they are not spooled."""


@dataclass
class UsageWriterStats:
    """Counters of a writer (a snapshot from `UsageWriter.stats()`)."""

    rows_written: int = 0
    """Records committed from live batches: one per request_id per batch (a retry of a request_id
    already in the table counts, though ON CONFLICT DO NOTHING adds no row)."""
    transactions: int = 0
    """Committed transactions, live and replay."""
    rows_spooled: int = 0
    rows_replayed: int = 0
    rows_rejected: int = 0
    """Spool lines moved to `<spool>.rejected` (unreadable, or refused by the database)."""
    last_commit_ms: float = 0.0


class UsageWriter:
    """Writes `UsageRecord`s into `usage_events` in group commits, from one dedicated thread.

    `engine` (SQLite or PostgreSQL, schema made by `upgrade_database`) is the caller's to dispose,
    after `close()`. `spool_path` must be on local disk and used by one writer at a time.
    """

    def __init__(self, engine: Engine, *, spool_path: Path, max_delay_s: float = 0.002,
                 max_batch: int = 2000, replay_interval_s: float = 1.0) -> None:
        if engine.dialect.name not in SUPPORTED_DIALECTS:
            raise ValueError(f"UsageWriter supports {', '.join(SUPPORTED_DIALECTS)}, not {engine.dialect.name}")
        if max_batch < 1 or max_delay_s < 0 or replay_interval_s <= 0:
            raise ValueError("max_batch must be >= 1, max_delay_s >= 0 and replay_interval_s > 0")
        self._engine = engine
        self._spool = UsageSpool(Path(spool_path))
        self._max_delay_s, self._max_batch = max_delay_s, max_batch
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Guards _started/_closed so no submit() can slip in behind close()'s _STOP.
        self._state_lock = threading.Lock()
        self._started = self._closed = False
        self._thread: threading.Thread | None = None
        self._stats_lock = threading.Lock()
        self._stats = UsageWriterStats()
        # Owned by the writer thread once it runs (set up by start() before that).
        self._replay = SpoolReplay(self._spool, insert_all=self._insert_all, count=self._count,
                                   chunk_rows=max_batch, interval_s=replay_interval_s)
        # request_id → the response to store in the same transaction as its row (see StoredResponse).
        # Filled by callers before queueing, drained by the writer thread; dict ops are atomic.
        self._responses: dict[str, StoredResponse] = {}
        # The connection every transaction runs on, under its lock: the writer thread's, or an inline commit's.
        self._kept = KeptConnection(engine)

    def spooled(self) -> list[UsageRecord]:
        """Rows in the spool (durable, perhaps not committed yet), read from any thread."""
        return read_spooled(self._spool.path)

    def start(self) -> None:
        """Create the spool if needed and start the writer thread (which replays the spool first)."""
        with self._state_lock:
            if self._started or self._closed:
                raise RuntimeError("a UsageWriter can be started once")
            self._replay.open()
            self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
            self._thread.start()
            self._started = True

    def submit(self, record: UsageRecord) -> concurrent.futures.Future[None]:
        """Queue `record`; the future resolves once its row is durable (database or spool).

        Thread-safe. The future is already RUNNING, so cancelling it (or the task awaiting it)
        cannot stop the row from being written: a request is metered even if its caller gives up.
        """
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        self._enqueue(record, future)
        return future

    async def write(self, record: UsageRecord, stored: StoredResponse | None = None) -> None:
        """Write `record` and wait until it is durable; raises if it could not be made durable.

        `stored`: an idempotent response committed in the same transaction as the row. While the
        database is down (rows go to the spool) it is not kept: a retry then runs again after the
        claim goes stale (gateway/billing/idempotency.py), and is billed as its own request.

        Like `await asyncio.wrap_future(self.submit(record))`, but the writer wakes each event loop
        once per batch instead of once per record. Cancelling the wait does not stop the write.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if stored is not None:
            self._responses[record.request_id] = stored
        self._enqueue(record, future)
        await future

    def try_write_now(self, record: UsageRecord, stored: StoredResponse | None = None) -> bool:
        """Commit `record` (and `stored`) on the calling thread if the database is SQLite, healthy and
        not being written by another process, and the writer thread idle: True once the row is
        committed; False, having written nothing, when the caller should `write()` instead (the writer
        busy or behind, the database down, locked or not SQLite, or this commit failing: `write()` then
        retries it and spools it if need be). Raises as `write()` would for a row the database refuses.

        For a caller with nothing else to do meanwhile (the gateway with one request in flight): it
        saves the two thread handoffs of `write()`, and blocks the calling thread for the commit (a
        local fsync; never a wait on a network or on another process's lock: those go to `write()`).
        """
        if self._engine.dialect.name != "sqlite" or not self._replay.db_healthy or not self._queue.empty() \
                or not self._kept.lock.acquire(blocking=False):
            return False
        try:
            with self._state_lock:
                if not self._started or self._closed:
                    return False
            if stored is not None:
                self._responses[record.request_id] = stored
            try:
                self._kept.fail_fast()
                bad = self._insert_all([record])
            except Exception as error:
                log.debug("inline usage commit failed, handing the row to the writer thread: %s", error)
                return False
        finally:
            self._kept.lock.release()
        if record.request_id in bad:
            raise bad[record.request_id]
        self._count("rows_written", 1)
        return True

    def _enqueue(self, record: UsageRecord, waiter: Waiter) -> None:
        if not isinstance(record, UsageRecord):
            raise TypeError(f"expected a UsageRecord, got {type(record).__name__}")
        with self._state_lock:
            if not self._started or self._closed:
                raise RuntimeError("the UsageWriter is not running")
            self._queue.put((record, waiter))

    def close(self, timeout: float | None = 30.0) -> None:
        """Write everything submitted so far, try a last replay of the spool, stop the thread.

        Raises TimeoutError if the thread has not finished within `timeout` seconds.
        """
        with self._state_lock:
            already, self._closed = self._closed, True
            if self._started and not already:
                self._queue.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the usage writer did not finish within {timeout} s")

    def stats(self) -> UsageWriterStats:
        """A snapshot of the counters."""
        with self._stats_lock:
            return replace(self._stats)

    # --- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("the usage writer thread failed")
            raise
        finally:
            with self._kept.lock:
                self._kept.close()
            with self._state_lock:
                self._closed = True
            # Only after a crash can anything be left; its callers must not wait forever.
            left: list[tuple[Waiter, BaseException | None]] = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    left.append((item[1], RuntimeError("the usage writer stopped")))
            settle(left)

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            item = self._next_item()
            if item is _STOP:
                stopping = True
            elif item is not None:
                batch, stopping = self._gather(item)
                with self._kept.lock:
                    self._kept.wait_on_locks()  # after inline commits (try_write_now) failed fast
                    self._write_batch(batch)
            with self._kept.lock:
                self._kept.wait_on_locks()
                self._replay.run_if_due(stopping=stopping)

    def _next_item(self) -> Any:
        """The next queued item; None when it is time to replay the spool instead."""
        if not self._replay.waiting_on_db():
            return self._queue.get()
        wait = self._replay.seconds_to_next()
        try:
            return self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _gather(self, first: _Item) -> tuple[list[_Item], bool]:
        """`first` plus what arrives within max_delay_s (up to max_batch); and whether _STOP came."""
        batch = [first]
        deadline = time.monotonic() + self._max_delay_s
        while len(batch) < self._max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if item is _STOP:
                return batch, True
            batch.append(item)
        return batch, False

    def _insert(self, records: list[UsageRecord]) -> None:
        """Insert `records` in one transaction (the only place that writes to the database; under the
        kept connection's lock, on the writer thread or in `try_write_now`)."""
        started = time.perf_counter()
        stored = [r for r in (self._responses.get(record.request_id) for record in records) if r is not None]
        connection = self._kept.get(started)
        try:
            with connection.begin():
                insert_records(connection, records)
                if stored:
                    store_responses(connection, stored)
        except _BAD_ROW_ERRORS:
            raise
        except BaseException:
            self._kept.close()  # perhaps broken: the next batch checks out a fresh one
            raise
        self._kept.used(time.perf_counter())
        for record in records:
            self._responses.pop(record.request_id, None)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        with self._stats_lock:
            self._stats.transactions += 1
            self._stats.last_commit_ms = elapsed_ms

    def _insert_all(self, records: list[UsageRecord]) -> dict[str, Exception]:
        """Insert `records`, each on its own if a bad row (unknown tenant...) spoils the batch.

        Returns the bad rows' errors by request_id; raises when the database itself fails.
        """
        try:
            self._insert(records)
            return {}
        except _BAD_ROW_ERRORS:
            pass
        bad: dict[str, Exception] = {}
        for record in records:
            try:
                self._insert([record])
            except _BAD_ROW_ERRORS as error:
                bad[record.request_id] = error
        return bad

    def _write_batch(self, batch: list[_Item]) -> None:
        # Concurrent submissions of one request_id share the first one's row.
        groups: dict[str, list[_Item]] = {}
        for item in batch:
            groups.setdefault(item[0].request_id, []).append(item)
        if self._replay.db_healthy:
            try:
                bad = self._insert_all([items[0][0] for items in groups.values()])
            except Exception as error:
                # Rows inserted one by one before the failure are spooled too: harmless duplicates.
                log.warning("usage insert failed, spooling %d rows: %s", len(groups), error)
                self._replay.mark_db_down()
            else:
                self._count("rows_written", len(groups) - len(bad))
                # A bad record's callers get its error; the others, success.
                settle([(waiter, bad.get(record.request_id)) for record, waiter in batch])
                return
        self._spool_groups(groups)

    def _spool_groups(self, groups: dict[str, list[_Item]]) -> None:
        batch = [item for items in groups.values() for item in items]
        dropped = sum(self._responses.pop(request_id, None) is not None for request_id in groups)
        if dropped:
            log.warning("database down: %d idempotent responses are not stored (their rows are spooled)", dropped)
        try:
            self._spool.append(items[0][0] for items in groups.values())
        except Exception as error:
            log.error("usage spool write failed, %d rows are not durable: %s", len(groups), error)
            settle([(waiter, error) for _, waiter in batch])
            return
        self._replay.pending = True
        self._count("rows_spooled", len(groups))
        settle([(waiter, None) for _, waiter in batch])

    def _count(self, name: str, n: int) -> None:
        with self._stats_lock:
            setattr(self._stats, name, getattr(self._stats, name) + n)
