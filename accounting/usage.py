"""The usage record of one served request, and the metering writer's spool file of them.

A `UsageRecord` has exactly the columns of `accounting.models.UsageEvent` except the surrogate `id`.
It is checked when it is made (tz-aware times, non-negative token counts, strings that fit their
columns), so a bad record fails in the caller, not later in the writer's batch or in its spool.
`to_json`/`from_json` are the line format of `UsageSpool` (one JSON object per line), the local
file where `accounting.usage_writer` keeps rows while the database is unavailable.
`insert_records` is how a batch of records gets into the table.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

from accounting.models import UsageEvent

log = logging.getLogger(__name__)

_TIME_FIELDS = ("started_at", "finished_at")
_TOKEN_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens")
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_COPY_SPECIAL = re.compile(r"[\\\t\n\r]")  # a search costs far less than a translate


def _max_lengths() -> dict[str, int]:
    """Column name → maximum length of the String columns of usage_events."""
    lengths: dict[str, int] = {}
    for column in UsageEvent.__table__.columns:
        length = getattr(column.type, "length", None)
        if isinstance(length, int):
            lengths[column.name] = length
    return lengths


_MAX_LENGTHS = _max_lengths()


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageRecord:
    """One request's usage; `request_id` is unique in the table (one row per request).

    Times must be timezone-aware; they are normalised to UTC. Immutable, so it can be handed to the
    writer thread without copying.
    """

    request_id: str
    tenant_id: int
    key_id: int | None = None
    model: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status: str
    """ok | client_disconnected | upstream_error | gateway_lost | rejected."""
    finish_reason: str | None = None
    ttft_ms: float | None = None
    latency_ms: float | None = None
    started_at: datetime
    finished_at: datetime
    batch_id: str | None = None
    route: str | None = None
    """The API route that served it: chat.completions | completions | responses (None on rows from
    before the column existed)."""

    def __post_init__(self) -> None:
        for name in _TIME_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, datetime) or value.tzinfo is None:
                raise ValueError(f"{name} must be a timezone-aware datetime, got {value!r}")
            object.__setattr__(self, name, value.astimezone(UTC))
        for name in _TOKEN_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        for name, length in _MAX_LENGTHS.items():
            value = getattr(self, name)
            if value is not None and (len(value) > length or "\x00" in value):
                raise ValueError(f"{name} is longer than {length} characters or holds a NUL")

    def to_row(self) -> dict[str, Any]:
        """The row to insert: column name → value (times as tz-aware datetimes)."""
        return {name: getattr(self, name) for name in FIELD_NAMES}

    def to_json(self) -> str:
        """One spool line (without the newline): a JSON object, times in ISO 8601 with offset."""
        row = self.to_row()
        for name in _TIME_FIELDS:
            row[name] = row[name].isoformat()
        return json.dumps(row, separators=(",", ":"))

    def to_copy_line(self) -> str:
        """The row as a line of PostgreSQL's COPY text format (columns in FIELD_NAMES order)."""
        cells = []
        for name in FIELD_NAMES:
            value = getattr(self, name)
            if value is None:
                cells.append("\\N")
            elif isinstance(value, str):
                cells.append(value.translate(_COPY_ESCAPES) if _COPY_SPECIAL.search(value) else value)
            elif isinstance(value, datetime):
                cells.append(value.isoformat())
            else:
                cells.append(str(value))
        return "\t".join(cells) + "\n"

    @classmethod
    def from_json(cls, line: str | bytes) -> UsageRecord:
        """The record of a `to_json` line; raises ValueError (or TypeError) on a malformed one."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a usage spool line must be a JSON object")
        for name in _TIME_FIELDS:
            if isinstance(data.get(name), str):
                data[name] = datetime.fromisoformat(data[name])
        return cls(**data)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(UsageRecord))
"""The record's fields, in order: the columns of usage_events except `id`."""

SUPPORTED_DIALECTS = ("postgresql", "sqlite")

_TABLE = cast(Table, UsageEvent.__table__)
_SQLITE_INSERT = sqlite.insert(_TABLE).on_conflict_do_nothing(index_elements=["request_id"])
# RETURNING is what makes SQLAlchemy batch it (see insert_records).
_POSTGRESQL_INSERT = (postgresql.insert(_TABLE).on_conflict_do_nothing(index_elements=["request_id"])
                      .returning(_TABLE.c.id))
_COLUMNS = ", ".join(FIELD_NAMES)
# The staging table lives in the connection's session (pg_temp) and is emptied by every commit.
_STAGE_SQL = (f"CREATE TEMP TABLE IF NOT EXISTS usage_events_stage ON COMMIT DELETE ROWS AS "
              f"SELECT {_COLUMNS} FROM usage_events WITH NO DATA")
_COPY_SQL = f"COPY usage_events_stage ({_COLUMNS}) FROM STDIN"
_MERGE_SQL = (f"INSERT INTO usage_events ({_COLUMNS}) SELECT {_COLUMNS} FROM usage_events_stage "
              f"ON CONFLICT (request_id) DO NOTHING")


def insert_records(connection: Connection, records: list[UsageRecord]) -> None:
    """Insert `records` in the caller's transaction; a request_id already in the table is skipped.

    - SQLite: INSERT ... ON CONFLICT (request_id) DO NOTHING, executemany (sqlite3 loops in C).
    - PostgreSQL with psycopg2: COPY into a session-local staging table, then INSERT ... SELECT ...
      ON CONFLICT (request_id) DO NOTHING. ~1.8x the rows/s of multi-row INSERTs (ops/bench/metering.py), mostly
      because it holds the GIL (shared with the gateway's event loop) far less time per row.
    - PostgreSQL with another driver: the ON CONFLICT DO NOTHING insert with RETURNING id, which
      makes SQLAlchemy's insertmanyvalues send multi-row INSERTs (without RETURNING, SQLAlchemy 2.1
      sends an ON CONFLICT executemany row by row).
    Errors are SQLAlchemy's (IntegrityError for an unknown tenant...), whichever way is taken.
    """
    dialect = connection.dialect
    if dialect.name == "postgresql" and dialect.driver == "psycopg2":
        _copy_records(connection, records)
    elif dialect.name in SUPPORTED_DIALECTS:
        statement = _POSTGRESQL_INSERT if dialect.name == "postgresql" else _SQLITE_INSERT
        connection.execute(statement, [record.to_row() for record in records])
    else:
        raise ValueError(f"usage rows go to {', '.join(SUPPORTED_DIALECTS)}, not {dialect.name}")


def _copy_records(connection: Connection, records: list[UsageRecord]) -> None:
    connection.exec_driver_sql(_STAGE_SQL)
    dialect = connection.dialect
    dbapi_connection = connection.connection.dbapi_connection
    cursor = dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.copy_expert(_COPY_SQL, io.StringIO("".join(record.to_copy_line() for record in records)))
    except dialect.loaded_dbapi.Error as error:
        # SQLAlchemy wraps only what it executes itself: wrap this the way it would.
        if dialect.is_disconnect(error, dbapi_connection, cursor):
            connection.invalidate(error)
        raise DBAPIError.instance(_COPY_SQL, None, error, dialect.loaded_dbapi.Error, dialect=dialect) from error
    finally:
        with contextlib.suppress(dialect.loaded_dbapi.Error):  # its connection may be gone
            cursor.close()
    connection.exec_driver_sql(_MERGE_SQL)


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
