"""What one commit of usage rows writes: the rows, and the idempotent responses stored with them.

`insert_records` is how a batch of `UsageRecord`s gets into usage_events (ON CONFLICT (request_id)
DO NOTHING, so a retried request_id never makes a second row; multi-row, or COPY on PostgreSQL).
`store_responses` fills the Idempotency-Key rows (`StoredResponse`) whose requests are in the
batch. `accounting.usage_writer` calls both inside its one transaction per batch.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Connection, Table, bindparam, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

from accounting.models import IdempotentResponse, UsageEvent
from accounting.usage import FIELD_NAMES, UsageRecord

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
