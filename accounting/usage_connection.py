"""The usage writer's database connection (accounting/usage_writer.py), kept from one transaction to the
next, and the lock under which one thread at a time runs a transaction on it.

A checkout and checkin per transaction (the pool's reset rollback, PostgreSQL's pre-ping round trip) cost as
much as a small batch's insert, so the connection stays checked out. One idle for `IDLE_S` is replaced, so a
server that dropped it meanwhile is pinged at checkout instead of failing a batch into the spool.

Ownership: whoever holds `lock` may call `get`, `used` and `close`: the writer thread for its batches and spool
replays, or a caller committing its own row inline (`UsageWriter.try_write_now`) while the thread is idle.
"""

from __future__ import annotations

import logging
import threading

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
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.close()
            except Exception as error:  # a dead connection may fail even to close
                log.debug("closing the usage writer's connection failed: %s", error)
