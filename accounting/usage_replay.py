"""The usage writer's way back from a database outage: its spool, replayed into usage_events.

While the database fails, `accounting.usage_writer` appends its batches to the spool
(`accounting.usage_spool`) and tells the callers their rows are durable. Invariant: an
acknowledged row is in the database or in the spool (possibly both), never neither. The spool is
replayed at start and every `interval_s` while it is not empty, with the same ON CONFLICT DO
NOTHING as live batches (so a replay, or a caller's retry of the same request_id, never makes a
second row), and truncated only once everything in it is committed. While the database is known
to be down, batches go straight to the spool; the replay is the probe that brings it back. Lines
that can never be inserted (unreadable, or refused by a constraint) are moved to
`<spool>.rejected` and logged, never dropped (a line may be repeated there when a replay that
rejected it is retried).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from accounting.usage import UsageRecord
from accounting.usage_spool import UsageSpool

log = logging.getLogger("accounting.usage_writer")  # the writer's parts log as the writer


class SpoolReplay:
    """The database's health as the writer thread sees it, and the replay of its spool.

    Owned by the usage writer's thread (set up by `UsageWriter.start` before that thread runs);
    not thread-safe. `insert_all` commits records (bad rows on their own: their errors by
    request_id; it raises when the database itself fails); `count` adds to the writer's stats.
    """

    def __init__(self, spool: UsageSpool, *, insert_all: Callable[[list[UsageRecord]], dict[str, Exception]],
                 count: Callable[[str, int], None], chunk_rows: int, interval_s: float) -> None:
        self._spool = spool
        self._insert_all, self._count = insert_all, count
        self._chunk_rows, self._interval_s = chunk_rows, interval_s
        self.pending = False  # the spool may hold rows that are not in the database yet
        self.db_healthy = True  # False from a failed commit until a replay succeeds, or interval_s passes
        self._offset = 0  # bytes of the spool already committed in this run
        self._next_at = 0.0

    def open(self) -> None:
        """Create the spool if needed; rows left in it (by an earlier run) are replayed first."""
        self.pending = self._spool.open() > 0

    def waiting_on_db(self) -> bool:
        """Whether a replay (or, with an empty spool, a retry of the database) is scheduled."""
        return self.pending or not self.db_healthy

    def seconds_to_next(self) -> float:
        """Until the scheduled replay or retry is due (<= 0: now)."""
        return self._next_at - time.monotonic()

    def mark_db_down(self) -> None:
        """The database failed: live batches go to the spool until a replay in `interval_s` succeeds."""
        self.db_healthy = False
        self._next_at = time.monotonic() + self._interval_s

    def run_if_due(self, *, stopping: bool) -> None:
        """Replay a chunk of the spool if one is due (all of it when `stopping`), or let the next
        batch try the database again when there is nothing to replay."""
        due = stopping or time.monotonic() >= self._next_at
        if self.pending and due:
            self._replay(until_empty=stopping)
        elif not self.db_healthy and due:
            self.db_healthy = True  # nothing to replay: the next batch tries the database again

    def _replay(self, *, until_empty: bool) -> None:
        """Replay one chunk of the spool (or all of it when `until_empty`), unless the database fails."""
        while True:
            try:
                emptied = self._replay_chunk()
            except Exception as error:
                log.warning("usage spool replay failed, retrying in %.1f s: %s", self._interval_s, error)
                self.mark_db_down()
                return
            self.db_healthy = True
            self._next_at = time.monotonic()  # keep draining, one chunk between live batches
            if emptied or not until_empty:
                return

    def _replay_chunk(self) -> bool:
        """Insert the next chunk_rows spool lines; True when the spool is thereby empty (cleared)."""
        chunk = self._spool.read(self._offset, self._chunk_rows)
        self._count("rows_rejected", chunk.unreadable)
        records: dict[str, UsageRecord] = {}
        for record in chunk.records:
            records.setdefault(record.request_id, record)  # the first one written wins, as in the table
        if records:
            bad = self._insert_all(list(records.values()))
            for request_id, error in bad.items():
                self._spool.reject(records[request_id].to_json(), f"refused by the database: {error}")
            self._count("rows_rejected", len(bad))
            self._count("rows_replayed", len(records) - len(bad))
        self._offset = chunk.end
        if not chunk.at_end:
            return False
        # Everything up to the end is committed, and only this thread appends: empty the spool.
        self._spool.clear()
        self._offset, self.pending = 0, False
        return True
