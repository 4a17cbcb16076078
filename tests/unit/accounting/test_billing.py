"""Prices, billing reports (exact Decimal costs), their CSV/JSON/HTML renderings and the CLI.

SQLite through the real migrations; usage events are inserted directly with the ORM. `seed` is
shared with tests/unit/gateway/test_usage_api.py and tests/e2e/test_report_browser.py.
"""

from __future__ import annotations

import csv
import io
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.models import Tenant, UsageEvent
from accounting.prices import InvalidPriceError, list_prices, price_at, price_to_dict, set_price
from accounting.report_render import to_csv, to_html, to_json
from accounting.reports import InvalidMonthError, UsageReport, usage_report
from accounting.settings import AccountingSettings
from accounting.tenants import AccountingError, TenantNotFoundError, create_tenant
from ops.cli import cli

MONTH = "2026-01"


def jan(day: int, hour: int = 12, minute: int = 0) -> datetime:
    return datetime(2026, 1, day, hour, minute, tzinfo=UTC)


def add_event(session: Session, tenant: Tenant, model: str, when: datetime, prompt: int = 0, cached: int = 0,
              completion: int = 0, batch_id: str | None = None) -> None:
    session.add(UsageEvent(request_id=uuid.uuid4().hex, tenant_id=tenant.id, model=model, prompt_tokens=prompt,
                           cached_tokens=cached, completion_tokens=completion, status="ok",
                           started_at=when - timedelta(seconds=1), finished_at=when, batch_id=batch_id))


def seed(session: Session) -> None:
    """acme and globex in January 2026: usage on days 3, 5, 7, 10, 20 (acme: 3, 10, 20).

    m1 costs 0.15 / 0.075 / 0.6 per 1M tokens, then twice that from Jan 15; m2 has no price.
    """
    acme, globex = create_tenant(session, "acme"), create_tenant(session, "globex")
    set_price(session, "m1", input_per_mtok="0.15", cached_input_per_mtok="0.075", output_per_mtok="0.6",
              batch_discount="0.5", effective_from=datetime(2025, 12, 1, tzinfo=UTC))
    set_price(session, "m1", input_per_mtok="0.3", cached_input_per_mtok="0.15", output_per_mtok="1.2",
              batch_discount="0.5", effective_from=jan(15, 0))
    add_event(session, acme, "m1", jan(3), 1234, 234, 567)
    add_event(session, acme, "m1", jan(10), 1000, 0, 500)
    add_event(session, acme, "m1", jan(20), 2000, 1000, 1000)
    add_event(session, acme, "m1", jan(20, 13), 1000, 0, 1000, batch_id="batch_1")
    add_event(session, globex, "m1", jan(5), 500, 0, 100)
    add_event(session, globex, "m2", jan(7), 100, 0, 10)
    # Outside January (UTC), by a microsecond either way.
    add_event(session, acme, "m1", datetime(2026, 2, 1, tzinfo=UTC), 9999, 0, 9999)
    add_event(session, acme, "m1", datetime(2025, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), 8888, 0, 8888)
    session.flush()


ACME_M1_COST = Decimal("0.00050775") + Decimal("0.00045") + Decimal("0.00165") + Decimal("0.00075")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'tollway.db'}")
    upgrade_database(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    with session_factory(engine)() as session, session.begin():
        yield session


@pytest.fixture
def report(session: Session) -> UsageReport:
    seed(session)
    return usage_report(session, MONTH)


def row(report: UsageReport, tenant: str, model: str):
    return next(r for r in report.rows if (r.tenant, r.model) == (tenant, model))


def test_costs_are_exact_with_cached_pricing_price_change_and_batch_discount(report: UsageReport) -> None:
    acme = row(report, "acme", "m1")
    assert (acme.requests, acme.prompt_tokens, acme.cached_tokens, acme.completion_tokens) == (4, 5234, 1234, 3067)
    assert acme.cost == ACME_M1_COST and isinstance(acme.cost, Decimal)
    per_day = {r.day.day: r.cost for r in report.daily if r.tenant == "acme"}
    # Jan 3 old price with cached tokens; Jan 20 new price, one batch event at half price.
    assert per_day == {3: Decimal("0.00050775"), 10: Decimal("0.00045"), 20: Decimal("0.0024")}
    assert row(report, "globex", "m1").cost == Decimal("0.000135")


def test_unpriced_usage_is_never_free(report: UsageReport) -> None:
    m2 = row(report, "globex", "m2")
    assert m2.cost is None and m2.unpriced_requests == 1 and m2.requests == 1
    assert [(r.tenant, r.model) for r in report.unpriced] == [("globex", "m2")]
    assert report.total.cost is None and report.total.requests == 6
    assert {d.day.day: d.cost is None for d in report.days} == {3: False, 5: False, 7: True, 10: False, 20: False}


def test_month_bounds_are_utc(session: Session) -> None:
    seed(session)
    acme = session.query(Tenant).filter_by(name="acme").one()
    # 00:30 on Feb 1 at UTC+1 is still January 31 in UTC.
    add_event(session, acme, "m1", datetime(2026, 2, 1, 0, 30, tzinfo=timezone(timedelta(hours=1))), 10, 0, 1)
    report = usage_report(session, MONTH, "acme")
    assert [d.day.day for d in report.days] == [3, 10, 20, 31]
    assert report.total.prompt_tokens == 1234 + 1000 + 2000 + 1000 + 10
    february = usage_report(session, "2026-02", "acme")
    assert [(d.day.isoformat(), d.prompt_tokens) for d in february.days] == [("2026-02-01", 9999)]
    assert usage_report(session, "2025-12").total.prompt_tokens == 8888
    assert len(report.month_days) == 31 and len(february.month_days) == 28


def test_tenant_filter(session: Session) -> None:
    seed(session)
    report = usage_report(session, MONTH, "acme")
    assert {r.tenant for r in report.rows} == {"acme"} and report.total.cost == ACME_M1_COST
    with pytest.raises(TenantNotFoundError):
        usage_report(session, MONTH, "nobody")


@pytest.mark.parametrize("month", ["2026-13", "2026-1", "2026-00", "January", "2026-01-01", ""])
def test_bad_month(session: Session, month: str) -> None:
    with pytest.raises(InvalidMonthError) as error:
        usage_report(session, month)
    assert isinstance(error.value, AccountingError)


def test_csv_and_json_shapes(report: UsageReport) -> None:
    rows = list(csv.DictReader(io.StringIO(to_csv(report))))
    assert [(r["tenant"], r["model"]) for r in rows] == [("acme", "m1"), ("globex", "m1"), ("globex", "m2")]
    assert rows[0]["month"] == MONTH and Decimal(rows[0]["cost"]) == ACME_M1_COST and rows[0]["requests"] == "4"
    assert rows[2]["cost"] == "" and rows[2]["unpriced_requests"] == "1"
    daily = list(csv.DictReader(io.StringIO(to_csv(report, daily=True))))
    assert len(daily) == 5 and daily[0]["day"] == "2026-01-03"
    assert sum(int(r["prompt_tokens"]) for r in daily) == report.total.prompt_tokens

    data = json.loads(to_json(report))
    assert data["month"] == MONTH and data["tenant"] is None
    assert data["models"][0] == {"tenant": "acme", "model": "m1", "requests": 4, "prompt_tokens": 5234,
                                 "cached_tokens": 1234, "completion_tokens": 3067, "total_tokens": 8301,
                                 "cost": "0.00335775", "unpriced_requests": 0}
    assert data["total"]["cost"] is None and data["unpriced"] == [{"tenant": "globex", "model": "m2", "requests": 1}]
    assert [d["day"] for d in data["days"]] == ["2026-01-03", "2026-01-05", "2026-01-07", "2026-01-10", "2026-01-20"]


def test_html_is_self_contained_with_one_bar_per_day(report: UsageReport) -> None:
    page = to_html(report)
    assert page.count('<rect class="bar"') == 5 and 'id="bar-2026-01-20"' in page
    assert "<title>" in page and "<svg" in page and 'class="legend' in page and "Tokens per day" in page
    assert "http:" not in page and "https:" not in page and "src=" not in page and "<script" not in page
    assert "unpriced" in page


def test_set_price_closes_the_open_price_and_validates(session: Session) -> None:
    first = set_price(session, "m", input_per_mtok=1, cached_input_per_mtok="0.5", output_per_mtok=2.5,
                      effective_from=jan(1, 0))
    second = set_price(session, "m", input_per_mtok=2, cached_input_per_mtok=1, output_per_mtok=5,
                       effective_from=jan(15, 0))
    assert first.effective_to == jan(15, 0) and second.effective_to is None
    assert price_at(session, "m", jan(14, 23, 59)) is first and price_at(session, "m", jan(15, 0)) is second
    assert price_at(session, "m", datetime(2025, 1, 1, tzinfo=UTC)) is None
    assert price_to_dict(first)["output_per_mtok"] == "2.5" and price_to_dict(second)["effective_to"] is None
    # The same start corrects the open price instead of adding an empty interval.
    again = set_price(session, "m", input_per_mtok=3, cached_input_per_mtok=1, output_per_mtok=5,
                      effective_from=jan(15, 0))
    assert again is second and second.input_per_mtok == Decimal(3) and len(list_prices(session, "m")) == 2
    bad = [dict(input_per_mtok=-1), dict(batch_discount="1.5"), dict(batch_discount=-0.1),
           dict(effective_from=jan(10)), dict(output_per_mtok="abc"), dict(output_per_mtok="0.0000001"),
           dict(output_per_mtok="NaN"), dict(input_per_mtok=True)]
    for change in bad:
        args = {"input_per_mtok": 1, "cached_input_per_mtok": 1, "output_per_mtok": 1,
                "effective_from": jan(20), **change}
        with pytest.raises(InvalidPriceError):
            set_price(session, "m", **args)
    assert len(list_prices(session)) == 2


# --- the CLI ------------------------------------------------------------------------------------

@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path))
    monkeypatch.delenv("TOLLWAY_DATABASE_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return tmp_path


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def test_cli_prices_set_and_list(home: Path) -> None:
    result = run("prices", "set", "m1", "--input", "0.15", "--cached-input", "0.075", "--output", "0.6",
                 "--batch-discount", "0.5", "--effective-from", "2026-01-01")
    assert result.exit_code == 0, result.output
    assert "from 2026-01-01 00:00 UTC" in result.stdout
    assert run("prices", "set", "m1", "--input", "1", "--cached-input", "1", "--output", "1",
               "--effective-from", "2026-02-01").exit_code == 0
    listing = run("prices", "list", "--model", "m1")
    assert listing.exit_code == 0 and "0.075" in listing.stdout and "2026-02-01 00:00" in listing.stdout
    for bad in (["--input", "-1"], ["--input", "1", "--effective-from", "2025-01-01"],
                ["--input", "1", "--effective-from", "yesterday"]):
        result = run("prices", "set", "m1", "--cached-input", "1", "--output", "1", *bad)
        assert result.exit_code == 1 and "error" in result.stderr


@pytest.fixture
def seeded_home(home: Path) -> Path:
    engine = create_db_engine(AccountingSettings().url)
    upgrade_database(engine)
    with session_factory(engine).begin() as session:
        seed(session)
    engine.dispose()
    return home


def test_cli_usage_report_formats(seeded_home: Path) -> None:
    result = run("usage", "report", "--month", MONTH)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].startswith("month,tenant,model,requests")
    result = run("usage", "report", "--month", MONTH, "--tenant", "acme", "--format", "json")
    assert result.exit_code == 0 and json.loads(result.stdout)["total"]["cost"] == "0.00335775"
    out = seeded_home / "report.html"
    result = run("usage", "report", "--month", MONTH, "--format", "html", "--out", str(out))
    assert result.exit_code == 0 and result.stdout == "" and "warning" in result.stderr
    assert out.read_text().count('<rect class="bar"') == 5
    assert len(run("usage", "report", "--month", MONTH, "--daily").stdout.splitlines()) == 6
    assert run("usage", "report", "--month", "2026-1").exit_code == 1
    assert run("usage", "report", "--month", MONTH, "--tenant", "nobody").exit_code == 1
    assert run("usage", "report", "--month", MONTH, "--format", "pdf").exit_code == 2


# --- PostgreSQL (day truncation differs from SQLite) ----------------------------------------

@pytest.mark.services
def test_report_on_postgresql_with_a_non_utc_session(postgres_schema: tuple[str, str]) -> None:
    # A session time zone far from UTC: days must still be cut at UTC midnight.
    url, schema = postgres_schema  # connect_args replace the URL's options: both are given here
    engine = create_engine(url, connect_args={"options": f"-csearch_path={schema} -ctimezone=Asia/Tokyo"})
    try:
        upgrade_database(engine)
        with session_factory(engine).begin() as session:
            seed(session)
            acme = session.query(Tenant).filter_by(name="acme").one()
            add_event(session, acme, "m1", jan(25, 23), 1, 0, 0)  # Jan 26 in Tokyo, Jan 25 in UTC
            report = usage_report(session, MONTH)
            assert [d.day.day for d in report.days] == [3, 5, 7, 10, 20, 25]
            assert row(report, "acme", "m1").cost == ACME_M1_COST + Decimal("0.0000003") and report.total.cost is None
            assert usage_report(session, "2026-02").total.prompt_tokens == 9999
            assert usage_report(session, "2025-12").total.prompt_tokens == 8888
    finally:
        engine.dispose()
