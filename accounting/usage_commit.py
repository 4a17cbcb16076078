"""What one commit of usage rows writes: the rows, and the idempotent responses stored with them.

`insert_records` is how a batch of `UsageRecord`s gets into usage_events (ON CONFLICT (request_id)
DO NOTHING, so a retried request_id never makes a second row; multi-row, or COPY on PostgreSQL).
`store_responses` fills the Idempotency-Key rows (`StoredResponse`) whose requests are in the
batch. `accounting.usage_writer` calls both inside its one transaction per batch.
"""

from __future__ import annotations

import contextlib
import functools
import io
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Connection, Table, bindparam, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

from accounting.models import IdempotentResponse, UsageEvent
from accounting.usage import FIELD_NAMES, TIME_FIELDS, UsageRecord

SUPPORTED_DIALECTS = ("postgresql", "sqlite")

_TABLE = cast(Table, UsageEvent.__table__)
_SQLITE_INSERT = sqlite.insert(_TABLE).on_conflict_do_nothing(index_elements=["request_id"])
# RETURNING is what makes SQLAlchemy batch it (see insert_records).
_POSTGRESQL_INSERT = (postgresql.insert(_TABLE).on_conflict_do_nothing(index_elements=["request_id"])
                      .returning(_TABLE.c.id))
_COLUMNS = ", ".join(FIELD_NAMES)
_SQLITE_TIME = cast(Callable[[datetime], str], sqlite.DATETIME().bind_processor(sqlite.dialect()))
"""A naive datetime as SQLite's DATETIME column text (UsageRecord times are UTC: see its __post_init__)."""
_COLUMN_VALUES = operator.attrgetter(*FIELD_NAMES)
"""A record's values in FIELD_NAMES order, in one call."""
_TIME_COLUMNS = tuple(FIELD_NAMES.index(name) for name in TIME_FIELDS)
_SQLITE_ROWS_PER_INSERT = 999 // len(FIELD_NAMES)
"""Rows of one SQLite INSERT: within the 999 parameters of SQLite builds before 3.32."""
# The staging table lives in the connection's session (pg_temp) and is emptied by every commit.
_STAGE_SQL = (f"CREATE TEMP TABLE IF NOT EXISTS usage_events_stage ON COMMIT DELETE ROWS AS "
              f"SELECT {_COLUMNS} FROM usage_events WITH NO DATA")
_COPY_SQL = f"COPY usage_events_stage ({_COLUMNS}) FROM STDIN"
_MERGE_SQL = (f"INSERT INTO usage_events ({_COLUMNS}) SELECT {_COLUMNS} FROM usage_events_stage "
              f"ON CONFLICT (request_id) DO NOTHING")


def insert_records(connection: Connection, records: list[UsageRecord]) -> None:
    """Insert `records` in the caller's transaction; a request_id already in the table is skipped.

    - SQLite: multi-row INSERT ... VALUES (...), (...) ... ON CONFLICT (request_id) DO NOTHING on the
      driver's cursor, up to `_SQLITE_ROWS_PER_INSERT` rows a statement. sqlite3 releases the GIL
      around each statement it steps, and the writer thread then waits for the event loop's thread
      to give it back (up to the 5 ms switch interval while the loop is busy): an executemany of 30
      rows took 12 ms at 64 clients, one statement takes one wait. (Through SQLAlchemy's compiled
      execute, the insert also cost ~50 us more a batch.)
    - PostgreSQL with psycopg2: COPY into a session-local staging table, then INSERT ... SELECT ...
      ON CONFLICT (request_id) DO NOTHING. ~1.8x the rows/s of multi-row INSERTs (ops/bench/metering.py), mostly
      because it holds the GIL (shared with the gateway's event loop) far less time per row.
    - Other drivers: SQLAlchemy's ON CONFLICT DO NOTHING insert; on PostgreSQL with RETURNING id, which
      makes SQLAlchemy's insertmanyvalues send multi-row INSERTs (without RETURNING, SQLAlchemy 2.1
      sends an ON CONFLICT executemany row by row).
    Errors are SQLAlchemy's (IntegrityError for an unknown tenant...), whichever way is taken.
    """
    dialect = connection.dialect
    if dialect.name == "postgresql" and dialect.driver == "psycopg2":
        connection.exec_driver_sql(_STAGE_SQL)
        lines = io.StringIO("".join(record.to_copy_line() for record in records))
        with _driver_cursor(connection, _COPY_SQL) as cursor:
            cursor.copy_expert(_COPY_SQL, lines)
        connection.exec_driver_sql(_MERGE_SQL)
    elif dialect.name == "sqlite" and dialect.driver == "pysqlite":
        for start in range(0, len(records), _SQLITE_ROWS_PER_INSERT):
            chunk = records[start:start + _SQLITE_ROWS_PER_INSERT]
            statement = _sqlite_insert(len(chunk))
            params = tuple(value for record in chunk for value in _sqlite_params(record))
            with _driver_cursor(connection, statement) as cursor:
                cursor.execute(statement, params)
    elif dialect.name in SUPPORTED_DIALECTS:  # another driver
        insert = _POSTGRESQL_INSERT if dialect.name == "postgresql" else _SQLITE_INSERT
        connection.execute(insert, [record.to_row() for record in records])
    else:
        raise ValueError(f"usage rows go to {', '.join(SUPPORTED_DIALECTS)}, not {dialect.name}")


def _sqlite_params(record: UsageRecord) -> list[Any]:
    """The record's columns (FIELD_NAMES order) as the SQLite driver takes them: times as the naive UTC text
    SQLAlchemy's own SQLite DATETIME stores (its bind processor writes it), so either path reads back alike."""
    values = list(_COLUMN_VALUES(record))
    for index in _TIME_COLUMNS:
        values[index] = _SQLITE_TIME(values[index].replace(tzinfo=None))
    return values


@functools.lru_cache(maxsize=_SQLITE_ROWS_PER_INSERT)
def _sqlite_insert(rows: int) -> str:
    values = "(" + ", ".join("?" * len(FIELD_NAMES)) + ")"
    return (f"INSERT INTO usage_events ({_COLUMNS}) VALUES {', '.join([values] * rows)} "
            f"ON CONFLICT (request_id) DO NOTHING")


@contextlib.contextmanager
def _driver_cursor(connection: Connection, statement: str) -> Iterator[Any]:
    """A cursor of `connection`'s driver connection (in its transaction) to run `statement` on; the
    driver's errors wrapped as SQLAlchemy wraps what it executes (IntegrityError, OperationalError...)."""
    dialect = connection.dialect
    dbapi_connection = connection.connection.dbapi_connection
    cursor = dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        yield cursor
    except dialect.loaded_dbapi.Error as error:
        if dialect.is_disconnect(error, dbapi_connection, cursor):
            connection.invalidate(error)
        raise DBAPIError.instance(statement, None, error, dialect.loaded_dbapi.Error, dialect=dialect) from error
    finally:
        with contextlib.suppress(dialect.loaded_dbapi.Error):  # its connection may be gone
            cursor.close()


@dataclass(frozen=True)
class StoredResponse:
    """A response to keep for replays of its Idempotency-Key, committed with its usage row."""

    tenant_id: int
    key: str
    status_code: int
    content_type: str
    body: bytes


_STORE_RESPONSE = (
    update(IdempotentResponse)
    .where(IdempotentResponse.tenant_id == bindparam("t"), IdempotentResponse.key == bindparam("k"),
           IdempotentResponse.body.is_(None))
    .values(status_code=bindparam("s"), content_type=bindparam("c"), body=bindparam("b"))
)


def store_responses(connection: Connection, stored: list[StoredResponse]) -> None:
    """Fill the claimed idempotency rows of `stored` in the caller's transaction (a claim already
    answered keeps its first response)."""
    connection.execute(_STORE_RESPONSE, [{"t": r.tenant_id, "k": r.key, "s": r.status_code, "c": r.content_type,
                                          "b": r.body} for r in stored])
