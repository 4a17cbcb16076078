"""Dashboard sessions in SQL: a random token whose hash alone is stored, valid until it expires, is
closed, or the admin key changes; expired rows are purged."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from accounting import dashboard_sessions as ds
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.models import DashboardSession, utcnow


@pytest.fixture
def session(tmp_path: Path):
    engine = create_db_engine(f"sqlite:///{tmp_path / 't.db'}")
    upgrade_database(engine)
    with session_factory(engine)() as session, session.begin():
        yield session
    engine.dispose()


def test_a_session_lives_until_it_expires_is_closed_or_the_key_changes(session: Session) -> None:
    now = utcnow()
    token, expires_at = ds.open_session(session, "key-1", timedelta(hours=12), now=now)
    assert expires_at == now + timedelta(hours=12) and len(token) >= 43
    assert ds.session_is_valid(session, token, "key-1", now=now + timedelta(hours=11))
    assert not ds.session_is_valid(session, token, "key-1", now=expires_at)  # expired
    assert not ds.session_is_valid(session, token, "key-2", now=now)  # the admin key changed
    assert not ds.session_is_valid(session, token + "x", "key-1", now=now)
    assert not ds.session_is_valid(session, "", "key-1") and not ds.session_is_valid(session, "x" * 200, "key-1")
    [row] = session.scalars(select(DashboardSession))
    assert row.token_hash == ds.token_hash(token) != token and "key-1" not in row.admin_key_fingerprint
    assert ds.close_session(session, token) and not ds.close_session(session, token)
    assert not ds.session_is_valid(session, token, "key-1", now=now)


def test_tokens_are_random_and_expired_rows_are_purged(session: Session) -> None:
    past = utcnow() - timedelta(days=1)
    old, _ = ds.open_session(session, "k", timedelta(hours=1), now=past)
    new, _ = ds.open_session(session, "k")  # purges the expired one on the way
    assert old != new
    assert [row.token_hash for row in session.scalars(select(DashboardSession))] == [ds.token_hash(new)]
    assert ds.admin_key_fingerprint("k") == ds.admin_key_fingerprint("k") != ds.admin_key_fingerprint("k2")
