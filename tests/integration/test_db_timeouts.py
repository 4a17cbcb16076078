"""The statement timeout on a live PostgreSQL: a statement running past it is cancelled by the
server, the URL's own options (the test schema's search_path) still apply, and migrations lift it
for their own transaction."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import exc, text

from accounting.db import MIGRATION_LOCK_KEY, create_db_engine, current_revision, upgrade_database

pytestmark = pytest.mark.services


def test_a_statement_past_the_timeout_is_cancelled_and_the_schema_option_kept(
        postgres_schema: tuple[str, str]) -> None:
    url, schema = postgres_schema
    engine = create_db_engine(url, statement_timeout_s=0.3)
    try:
        with engine.connect() as connection:
            assert connection.execute(text("SHOW statement_timeout")).scalar() == "300ms"
            assert schema in connection.execute(text("SHOW search_path")).scalar()
            connection.execute(text("SELECT pg_sleep(0.05)"))  # under the limit: fine
        with engine.connect() as connection, pytest.raises(exc.OperationalError, match="statement timeout"):
            connection.execute(text("SELECT pg_sleep(5)"))
    finally:
        engine.dispose()


def test_migrations_run_without_the_statement_timeout(postgres_schema: tuple[str, str]) -> None:
    """A replica waits on the migration lock while another migrates, longer than the timeout."""
    url, _ = postgres_schema
    holder = create_db_engine(url)
    engine = create_db_engine(url, statement_timeout_s=0.2)
    try:
        with holder.connect() as other:
            other.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            release = threading.Timer(1.0, lambda: other.execute(
                text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY}))
            release.start()
            started = time.monotonic()
            upgrade_database(engine)  # waits ~1 s for the lock: past 0.2 s, and not cancelled
            release.join()
        assert time.monotonic() - started >= 0.9
        assert current_revision(engine) is not None
    finally:
        engine.dispose()
        holder.dispose()
