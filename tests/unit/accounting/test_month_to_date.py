"""A tenant's month-to-date spend, what monthly budgets are seeded from: committed interactive rows
of the month, plus spooled rows not committed yet (each request counted once)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.month_to_date import month_bounds, month_to_date_tokens
from accounting.tenants import create_tenant
from accounting.usage import UsageRecord
from accounting.usage_commit import insert_records
from accounting.usage_spool import read_spooled


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    url = f"sqlite:///{tmp_path / 'tollway.db'}"
    upgrade_database(url)
    engine = create_db_engine(url)
    with session_factory(engine)() as session:
        create_tenant(session, "acme")
        create_tenant(session, "other")
        session.commit()
        yield session
    engine.dispose()


def row(request_id: str, when: datetime, tenant_id: int = 1, batch_id: str | None = None,
        prompt: int = 10, completion: int = 5) -> UsageRecord:
    return UsageRecord(request_id=request_id, tenant_id=tenant_id, model="m", prompt_tokens=prompt,
                       completion_tokens=completion, status="ok", started_at=when, finished_at=when,
                       batch_id=batch_id)


def test_month_bounds_roll_over_the_year() -> None:
    assert month_bounds(202612) == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    with pytest.raises(ValueError):
        month_bounds(202613)


def test_committed_and_spooled_rows_of_the_month_count_once(session: Session, tmp_path: Path) -> None:
    november, october = datetime(2026, 11, 20, tzinfo=UTC), datetime(2026, 10, 31, 23, 59, tzinfo=UTC)
    insert_records(session.connection(), [
        row("a", november), row("b", november, completion=20),
        row("old", october), row("theirs", november, tenant_id=2),
        row("batch-line", november, batch_id="batch_1"),  # batch lines reserve against the budget too
    ])
    session.commit()
    assert month_to_date_tokens(session, 1, 202611) == 15 + 30 + 15
    spooled = [row("b", november, completion=20), row("c", november, prompt=100, completion=0),  # b is committed
               row("d", november, batch_id="batch_1", prompt=7, completion=0)]
    assert month_to_date_tokens(session, 1, 202611, spooled) == 15 + 30 + 15 + 100 + 7
    assert month_to_date_tokens(session, 1, 202610) == 15


def test_a_spool_is_read_while_it_is_being_written(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    when = datetime(2026, 11, 20, tzinfo=UTC)
    path.write_text(row("x", when).to_json() + "\n" + '{"request_id": "torn', encoding="utf-8")
    assert [r.request_id for r in read_spooled(path)] == ["x"]
    assert read_spooled(tmp_path / "absent.jsonl") == []
