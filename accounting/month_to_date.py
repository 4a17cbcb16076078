"""What a tenant spent in a calendar month, for the monthly token budget.

The gateway's quota stores keep a month's spend in memory or Redis; both are seeded from here
(usage_events, plus usage-spool rows not committed yet) so that a budget spent before a restart,
or before Redis lost its keys, stays spent. It counts what the budget counts: prompt + completion
tokens of every request, batch lines included (they reserve against the budget too), by the month
their request started in (the month its admission was charged to).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from accounting.models import UsageEvent
from accounting.usage import UsageRecord


def month_bounds(month: int) -> tuple[datetime, datetime]:
    """[start, end) of a YYYYMM month, in UTC."""
    year, number = divmod(month, 100)
    if not 1 <= number <= 12:
        raise ValueError(f"not a YYYYMM month: {month}")
    start = datetime(year, number, 1, tzinfo=UTC)
    end = datetime(year + number // 12, number % 12 + 1, 1, tzinfo=UTC)
    return start, end


def month_to_date_tokens(session: Session, tenant_id: int, month: int,
                         spooled: Iterable[UsageRecord] = ()) -> int:
    """Prompt + completion tokens of the tenant's requests (batch lines too) started in `month`: the
    committed rows, plus `spooled` rows (the usage spool) that are not committed yet."""
    start, end = month_bounds(month)
    committed: int = session.scalar(
        select(func.coalesce(func.sum(UsageEvent.prompt_tokens + UsageEvent.completion_tokens), 0)).where(
            UsageEvent.tenant_id == tenant_id,
            UsageEvent.started_at >= start, UsageEvent.started_at < end)) or 0
    pending = {r.request_id: r for r in spooled
               if r.tenant_id == tenant_id and start <= r.started_at < end}
    if pending:
        present = set(session.scalars(select(UsageEvent.request_id).where(UsageEvent.request_id.in_(pending))))
        committed += sum(r.prompt_tokens + r.completion_tokens for rid, r in pending.items() if rid not in present)
    return int(committed)
