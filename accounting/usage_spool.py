"""The usage writer's spool: a local JSON-lines file of usage rows that may not be in the database yet.

`accounting.usage_writer` appends a batch here when the database fails and tells its callers the
rows are durable; `accounting.usage_replay` reads the file back in chunks and clears it once every
row in it is committed. Lines are `UsageRecord.to_json` lines; lines that can never be inserted
are moved to `<spool>.rejected`, never dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from accounting.usage import UsageRecord

log = logging.getLogger("accounting.usage")  # one logger for usage records and their spool


class SpoolChunk(NamedTuple):
    """A piece of the spool read by `UsageSpool.read`."""

    records: list[UsageRecord]
    end: int
    """Offset just past the piece: where the next read starts."""
    at_end: bool
    """Whether the piece reaches the end of the file."""
    unreadable: int
    """Lines that could not be parsed (moved to the rejected file)."""


class UsageSpool:
    """A local JSON-lines file of usage rows that may not be in the database yet.

    Not thread-safe: one owner (the usage writer's thread) appends, reads and clears it. Appends
    are fsync'd before they return. A line left partial by a crash or a failed append is isolated
    (the next append starts a new line) and moved to `<name>.rejected` when read, never dropped.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.rejected_path = self.path.with_name(self.path.name + ".rejected")
        self._torn = False  # the file may end in a partial line

    def open(self) -> int:
        """Create the file (and its folder) if needed, durably; the file's size in bytes."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            self.path.touch()
            _fsync_directory(self.path.parent)  # the new file's name must survive a crash too
        with open(self.path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            if size:
                file.seek(size - 1)
                self._torn = file.read(1) != b"\n"
        return size

    def append(self, records: Iterable[UsageRecord]) -> None:
        """Append `records`, one line each, and fsync; raises OSError when they are not durable."""
        text = "".join(record.to_json() + "\n" for record in records)
        prefix = "\n" if self._torn else ""
        self._torn = True  # until this append is known to be complete
        _append(self.path, prefix + text)
        self._torn = False

    def read(self, offset: int, limit: int) -> SpoolChunk:
        """Up to `limit` records from byte `offset` on."""
        records: list[UsageRecord] = []
        unreadable = 0
        with open(self.path, "rb") as file:
            file.seek(offset)
            while len(records) < limit:
                line = file.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    records.append(UsageRecord.from_json(line))
                except (ValueError, TypeError) as error:
                    # A line torn by a crash was never acknowledged; kept for a human all the same.
                    self.reject(line.decode("utf-8", "replace").strip(), f"unreadable: {error}")
                    unreadable += 1
            end = file.tell()
            at_end = end >= file.seek(0, os.SEEK_END)
        return SpoolChunk(records, end, at_end, unreadable)

    def clear(self) -> None:
        """Empty the file (durably); only once every row in it is committed."""
        with open(self.path, "r+b") as file:
            file.truncate(0)
            file.flush()
            os.fsync(file.fileno())
        self._torn = False

    def reject(self, line: str, reason: str) -> None:
        """Move one line to the rejected file (fsync'd; raises OSError if that fails)."""
        log.error("usage spool line moved to %s (%s): %s", self.rejected_path, reason, line[:200])
        _append(self.rejected_path, line + "\n")


def read_spooled(path: Path) -> list[UsageRecord]:
    """Every readable record of a spool file, read by anyone (the writer thread may be appending:
    a partial last line is skipped). Rows in it may also be committed already."""
    records = []
    try:
        with open(path, "rb") as file:
            for line in file:
                if line.strip():
                    with contextlib.suppress(ValueError, TypeError):
                        records.append(UsageRecord.from_json(line))
    except FileNotFoundError:
        pass
    return records


def _append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not possible on some platforms (Windows); the file itself is still fsync'd
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
