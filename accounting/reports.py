"""Billing reports: usage and cost per tenant, model and day over one UTC calendar month.

The database groups the month's usage events by tenant, model, UTC day, batch flag and the price
in effect at each event's finished_at (one correlated lookup per event); the cost of each group is
then computed here in exact Decimal arithmetic, since cost is linear in the token counts:

    cost = ((prompt - cached) × input + cached × cached_input + completion × output) / 1,000,000
           × (1 - batch_discount)   [batch requests only]

Events whose model had no price at that time are never counted as free: the cost of any row (or
day, or total) that includes one is None, and `UsageReport.unpriced` lists them. Every event counts
as a request whatever its status (tokens used before a failure are billed).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, localcontext
from typing import Any

from sqlalchemy import Date, and_, case, cast, func, or_, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from accounting.models import Price, Tenant, UsageEvent
from accounting.prices import decimal_text
from accounting.tenants import AccountingError, get_tenant

_MONTH = re.compile(r"(\d{4})-(\d{2})")
MTOK = Decimal(1_000_000)
# Token sums × prices can exceed the default 28 significant digits: compute with room to spare.
COST_PRECISION = 60


class InvalidMonthError(AccountingError):
    """The month is not YYYY-MM."""


def parse_month(month: str) -> tuple[datetime, datetime]:
    """The UTC bounds [start, end) of a "YYYY-MM" month."""
    match = _MONTH.fullmatch(month) if isinstance(month, str) else None
    if match is None or not 1 <= int(match[2]) <= 12 or int(match[1]) < 1:
        raise InvalidMonthError(f"month must be YYYY-MM (e.g. 2026-01), got {month!r}")
    year, number = int(match[1]), int(match[2])
    if (year, number) == (9999, 12):
        raise InvalidMonthError(f"month {month!r} is out of range")
    start = datetime(year, number, 1, tzinfo=UTC)
    end = datetime(year + 1, 1, 1, tzinfo=UTC) if number == 12 else datetime(year, number + 1, 1, tzinfo=UTC)
    return start, end


@dataclass
class Usage:
    """Counts and cost of some requests; cost is None when any of them had no price."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost: Decimal | None = Decimal(0)
    unpriced_requests: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: Usage) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.unpriced_requests += other.unpriced_requests
        self.cost = None if self.cost is None or other.cost is None else self.cost + other.cost


@dataclass
class ModelUsage(Usage):
    """One tenant's usage of one model over the month (`day` None) or on one UTC day."""

    tenant: str = ""
    model: str = ""
    day: date | None = None


@dataclass
class DayUsage(Usage):
    """Everything in the report on one UTC day (the chart's bars)."""

    day: date = date.min


@dataclass
class UsageReport:
    """A month's usage: `rows` per tenant and model, `daily` per tenant, model and day, `days` per day.

    Lists are sorted (tenant, model, day); days without usage are left out of `daily` and `days`.
    """

    month: str
    start: datetime
    end: datetime
    tenant: str | None
    rows: list[ModelUsage] = field(default_factory=list)
    daily: list[ModelUsage] = field(default_factory=list)
    days: list[DayUsage] = field(default_factory=list)
    total: Usage = field(default_factory=Usage)

    @property
    def unpriced(self) -> list[ModelUsage]:
        """The tenant/model rows with requests that had no price (their cost is None)."""
        return [row for row in self.rows if row.unpriced_requests]

    @property
    def month_days(self) -> list[date]:
        """Every UTC day of the month, for chart axes."""
        first = self.start.date()
        return [first + timedelta(days=n) for n in range((self.end - self.start).days)]


def _day_expression(dialect: str) -> ColumnElement[Any]:
    """The UTC calendar day of finished_at, per dialect (normalised by `_as_date`)."""
    if dialect == "sqlite":  # stored as naive UTC text 'YYYY-MM-DD HH:MM:SS...': date() → 'YYYY-MM-DD'
        return func.date(UsageEvent.finished_at)
    if dialect == "postgresql":  # timestamptz: convert to UTC first, whatever the session's TimeZone
        return cast(func.timezone("UTC", UsageEvent.finished_at), Date)
    return cast(UsageEvent.finished_at, Date)


def _as_date(value: object) -> date:
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    return date.fromisoformat(str(value)[:10])


def _cost(prompt: int, cached: int, completion: int, price: Price | None, batch: bool) -> Decimal | None:
    if price is None:
        return None
    with localcontext() as context:
        context.prec = COST_PRECISION
        cost = ((prompt - cached) * price.input_per_mtok + cached * price.cached_input_per_mtok
                + completion * price.output_per_mtok) / MTOK
        if batch:
            cost *= 1 - price.batch_discount
        return +cost  # rounded to COST_PRECISION digits: exact for any realistic sums


def _grouped(session: Session, start: datetime, end: datetime, tenant_id: int | None) -> list[Any]:
    """(tenant, model, day, batch, price_id, requests, prompt, cached, completion) per group."""
    dialect = session.get_bind().dialect.name
    # The price in effect at finished_at; with well-formed history (see accounting.prices) at most
    # one matches, and should hand-made rows overlap, the latest start wins: never double counting.
    price_id = (
        select(Price.id)
        .where(Price.model == UsageEvent.model, Price.effective_from <= UsageEvent.finished_at,
               or_(Price.effective_to.is_(None), Price.effective_to > UsageEvent.finished_at))
        .order_by(Price.effective_from.desc()).limit(1)
        .correlate(UsageEvent).scalar_subquery()
    )
    where = [UsageEvent.finished_at >= start, UsageEvent.finished_at < end]
    if tenant_id is not None:
        where.append(UsageEvent.tenant_id == tenant_id)
    events = select(
        UsageEvent.tenant_id, UsageEvent.model, _day_expression(dialect).label("day"),
        case((UsageEvent.batch_id.is_(None), 0), else_=1).label("batch"), price_id.label("price_id"),
        UsageEvent.prompt_tokens, UsageEvent.cached_tokens, UsageEvent.completion_tokens,
    ).where(and_(*where)).subquery()
    keys = (Tenant.name, events.c.model, events.c.day, events.c.batch, events.c.price_id)
    query = (
        select(*keys, func.count(), func.sum(events.c.prompt_tokens), func.sum(events.c.cached_tokens),
               func.sum(events.c.completion_tokens))
        .join(Tenant, Tenant.id == events.c.tenant_id)
        .group_by(*keys)
    )
    return list(session.execute(query))


def _sorted_groups(groups: dict[Any, Any]) -> Iterable[Any]:
    return (groups[key] for key in sorted(groups))


def usage_report(session: Session, month: str, tenant: str | None = None) -> UsageReport:
    """The usage report of `month` ("YYYY-MM", UTC), of every tenant or only `tenant` (by name).

    Raises InvalidMonthError for a malformed month and TenantNotFoundError for an unknown tenant.
    """
    start, end = parse_month(month)
    tenant_id = get_tenant(session, tenant).id if tenant is not None else None
    groups = _grouped(session, start, end, tenant_id)
    price_ids = {row[4] for row in groups if row[4] is not None}
    prices = {p.id: p for p in session.scalars(select(Price).where(Price.id.in_(price_ids)))} if price_ids else {}

    rows: dict[tuple[str, str], ModelUsage] = {}
    daily: dict[tuple[str, str, date], ModelUsage] = {}
    days: dict[date, DayUsage] = {}
    total = Usage()
    for name, model, raw_day, batch, price_id, requests, prompt, cached, completion in groups:
        day = _as_date(raw_day)
        prompt, cached, completion = int(prompt or 0), int(cached or 0), int(completion or 0)
        price = prices.get(price_id) if price_id is not None else None
        part = Usage(requests=int(requests), prompt_tokens=prompt, cached_tokens=cached,
                     completion_tokens=completion, cost=_cost(prompt, cached, completion, price, bool(batch)),
                     unpriced_requests=0 if price is not None else int(requests))
        rows.setdefault((name, model), ModelUsage(tenant=name, model=model)).add(part)
        daily.setdefault((name, model, day), ModelUsage(tenant=name, model=model, day=day)).add(part)
        days.setdefault(day, DayUsage(day=day)).add(part)
        total.add(part)
    return UsageReport(month=month, start=start, end=end, tenant=tenant, rows=list(_sorted_groups(rows)),
                       daily=list(_sorted_groups(daily)), days=list(_sorted_groups(days)), total=total)


def usage_to_dict(usage: Usage) -> dict[str, Any]:
    """Counts and cost as JSON-ready data (cost as an exact decimal string, or None when unpriced)."""
    data: dict[str, Any] = {}
    if isinstance(usage, ModelUsage):
        data.update(tenant=usage.tenant, model=usage.model)
    day = getattr(usage, "day", None)
    if day is not None:
        data["day"] = day.isoformat()
    data.update(requests=usage.requests, prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
                cost=decimal_text(usage.cost), unpriced_requests=usage.unpriced_requests)
    return data


def report_to_dict(report: UsageReport) -> dict[str, Any]:
    """The whole report as JSON-ready data."""
    return {
        "object": "usage_report", "month": report.month, "tenant": report.tenant,
        "start": report.start.isoformat(), "end": report.end.isoformat(),
        "models": [usage_to_dict(row) for row in report.rows],
        "daily": [usage_to_dict(row) for row in report.daily],
        "days": [usage_to_dict(day) for day in report.days],
        "total": usage_to_dict(report.total),
        "unpriced": [{"tenant": row.tenant, "model": row.model, "requests": row.unpriced_requests}
                     for row in report.unpriced],
    }
