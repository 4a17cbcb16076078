"""No wait on PostgreSQL is unbounded: connecting gives up after the connect timeout, and every
connection carries a statement timeout next to the options its URL already has (the statement
timeout on a live server: tests/integration/test_db_timeouts.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import exc
from sqlalchemy.engine import make_url

from accounting.db import create_db_engine, postgres_connect_args
from tests.net import silent_listener


def test_connect_args_bound_connecting_and_statements_and_keep_the_urls_options() -> None:
    url = make_url("postgresql+psycopg2://u@h/db?options=-csearch_path%3Dtenant_x")
    args = postgres_connect_args(url, connect_timeout_s=0.5, statement_timeout_s=2.5)
    assert args == {"connect_timeout": 2, "options": "-csearch_path=tenant_x -c statement_timeout=2500"}
    assert postgres_connect_args(make_url("postgresql://u@h/db"), 7.2, 0) == {"connect_timeout": 8}


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A PostgreSQL that hangs: without a connect timeout, libpq would wait on it forever."""
    with silent_listener() as port:
        yield port


def test_connecting_to_a_server_that_never_answers_gives_up(silent_server: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_DB_CONNECT_TIMEOUT_S", "2")  # the setting, as a deployment gives it
    engine = create_db_engine(f"postgresql+psycopg2://tollway@127.0.0.1:{silent_server}/tollway")
    started = time.monotonic()
    try:
        with pytest.raises(exc.OperationalError, match="timeout"):
            engine.connect()
    finally:
        engine.dispose()
    assert time.monotonic() - started < 10
