"""The usage writer's database connection (accounting/usage_writer.py), kept from one transaction to the
next, and the lock under which one thread at a time runs a transaction on it.

A checkout and checkin per transaction (the pool's reset rollback, PostgreSQL's pre-ping round trip) cost as
much as a small batch's insert, so the connection stays checked out. One idle for `IDLE_S` is replaced, so a
server that dropped it meanwhile is pinged at checkout instead of failing a batch into the spool.

Ownership: whoever holds `lock` may call its methods: the writer thread for its batches and spool replays
(after `wait_on_locks`: they wait out another process's write lock), or a caller committing its own row inline
(`UsageWriter.try_write_now`, after `fail_fast`: it must never wait on one) while the thread is idle.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy import Connection, Engine

log = logging.getLogger(__name__)

IDLE_S = 30.0
"""A connection unused this long is closed and a fresh one checked out (pinged) instead."""


class KeptConnection:
    def __init__(self, engine: Engine) -> None:
        self.lock = threading.Lock()
        self._engine = engine
        self._connection: Connection | None = None
        self._used_at = 0.0
        self._busy_timeout_ms: int | None = None  # SQLite's, as this engine's connections start (read once)
        self._failing_fast = False  # the kept connection's busy timeout is 0 until `wait_on_locks`

    def get(self, now: float) -> Connection:
        """The kept connection (a fresh one at first, after `close`, or after IDLE_S unused)."""
        if self._connection is not None and now - self._used_at > IDLE_S:
            self.close()
        if self._connection is None:
            self._connection = self._engine.connect()
        return self._connection

    def used(self, now: float) -> None:
        """A transaction on it committed at `now` (perf_counter seconds)."""
        self._used_at = now

    def close(self) -> None:
        """Drop the connection (after a failure it may be broken; the next `get` checks out a fresh one)."""
        self.wait_on_locks()  # the pool may hand it to anyone next
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.close()
            except Exception as error:  # a dead connection may fail even to close
                log.debug("closing the usage writer's connection failed: %s", error)

    def fail_fast(self) -> None:
        """SQLite: from now on a database another process is writing fails at once (SQLITE_BUSY) instead
        of waiting up to the driver's busy timeout, until `wait_on_locks` or `close` (the connection goes
        back to the pool waiting). Sticky, so that commits made one after another the same way (inline
        ones at one client) set the busy timeout once, not twice each."""
        connection = self.get(time.perf_counter())  # one replaced for idling comes back waiting
        if self._failing_fast:
            return
        driver = self._driver(connection)
        if self._busy_timeout_ms is None:  # every connection of the engine starts with the same
            self._busy_timeout_ms = int(driver.execute("PRAGMA busy_timeout").fetchone()[0])
        driver.execute("PRAGMA busy_timeout = 0")
        self._failing_fast = True

    def wait_on_locks(self) -> None:
        """Undo `fail_fast`: a locked database is waited for up to the driver's busy timeout again."""
        if self._failing_fast and self._connection is not None:
            try:
                self._driver(self._connection).execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
            except Exception as error:  # a broken connection: the pool discards it
                log.debug("restoring the busy timeout failed: %s", error)
        self._failing_fast = False

    @staticmethod
    def _driver(connection: Connection) -> Any:
        """The DB-API connection under `connection` (sqlite3's here)."""
        driver = connection.connection.driver_connection
        assert driver is not None  # a checked-out connection always has one
        return driver
