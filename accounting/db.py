"""Engines, sessions and schema migrations of the accounting database.

The schema is made only by Alembic (`migrations/`), never by `Base.metadata.create_all`, so
development, tests and production run the same DDL. There is no alembic.ini: the Alembic
configuration is built here. Nothing connects at import time.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

from accounting.settings import AccountingSettings

LIBPQ_MIN_CONNECT_TIMEOUT_S = 2  # libpq treats 1 as 2; 0 would mean "wait forever"


def postgres_connect_args(url: URL, connect_timeout_s: float, statement_timeout_s: float) -> dict[str, Any]:
    """libpq arguments bounding every wait on the server: `connect_timeout` (whole seconds) and a
    `statement_timeout` given as a startup option, appended to any `options` the URL already
    carries (tests select a schema with `options=-csearch_path=...`)."""
    args: dict[str, Any] = {"connect_timeout": max(LIBPQ_MIN_CONNECT_TIMEOUT_S, math.ceil(connect_timeout_s))}
    if statement_timeout_s > 0:
        existing = url.query.get("options", "")
        existing = existing if isinstance(existing, str) else " ".join(existing)
        args["options"] = f"{existing} -c statement_timeout={math.ceil(statement_timeout_s * 1000)}".strip()
    return args


def create_db_engine(url: str, *, connect_timeout_s: float | None = None,
                     statement_timeout_s: float | None = None) -> Engine:
    """An engine for `url` with tollway's connection settings.

    SQLite: usable from several threads, WAL journal (readers don't block the writer) and foreign
    keys enforced (SQLite ignores them unless asked, per connection). PostgreSQL: connections are
    checked before use, so a restarted server doesn't fail the first request, and no wait is
    unbounded: connecting gives up after `connect_timeout_s`, a statement after
    `statement_timeout_s` (defaults: TOLLWAY_DB_CONNECT_TIMEOUT_S, TOLLWAY_DB_STATEMENT_TIMEOUT_S).
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            # Runs before the pool hands the connection out, i.e. outside any transaction,
            # which both pragmas require.
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA foreign_keys=ON")
            finally:
                cursor.close()

        return engine
    if parsed.get_backend_name() == "postgresql":
        if connect_timeout_s is None or statement_timeout_s is None:
            settings = AccountingSettings()
            connect_timeout_s = settings.db_connect_timeout_s if connect_timeout_s is None else connect_timeout_s
            statement_timeout_s = settings.db_statement_timeout_s if statement_timeout_s is None \
                else statement_timeout_s
        return create_engine(url, pool_pre_ping=True,
                             connect_args=postgres_connect_args(parsed, connect_timeout_s, statement_timeout_s))
    return create_engine(url)


def migrations_folder() -> Path:
    """The folder of the `migrations` package (Alembic's script_location)."""
    spec = importlib.util.find_spec("migrations")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / "env.py").is_file():
            return Path(location)
    raise RuntimeError("the tollway `migrations` package (with env.py) is not importable; is tollway installed?")


def alembic_config(url: str | None = None) -> Config:
    """An Alembic configuration for tollway's migrations, optionally bound to `url`."""
    config = Config()
    config.set_main_option("script_location", str(migrations_folder()))
    if url is not None:
        # Config values go through configparser interpolation: a literal % must be doubled.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


MIGRATION_LOCK_KEY = 0x746F6C6C  # "toll": the advisory lock that serialises migrations


def _run(url_or_engine: str | Engine, action: Any, revision: str) -> None:
    engine = create_db_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                # A migration may rewrite a large table, and a replica may wait here while another
                # migrates: the statement timeout is lifted for this transaction only.
                connection.execute(text("SET LOCAL statement_timeout = 0"))
                # Replicas starting together migrate one at a time (released at commit); the others
                # then find the schema at head and do nothing.
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            config = alembic_config()
            # migrations/env.py uses this connection instead of making its own engine.
            config.attributes["connection"] = connection
            action(config, revision)
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()


def upgrade_database(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Migrate the database up to `revision` (idempotent: a database at head is left alone)."""
    _run(url_or_engine, command.upgrade, revision)


def downgrade_database(url_or_engine: str | Engine, revision: str = "base") -> None:
    """Migrate the database down to `revision` ("base" removes every tollway table)."""
    _run(url_or_engine, command.downgrade, revision)


def current_revision(engine: Engine) -> str | None:
    """The Alembic revision the database is at, or None when it was never migrated."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions on `engine`; objects stay readable after commit (expire_on_commit=False)."""
    return sessionmaker(bind=engine, expire_on_commit=False)
