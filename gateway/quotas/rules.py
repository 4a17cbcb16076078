"""The rules every quota store applies alike (the semantics in `gateway.quotas.store`'s docstring).

`LocalQuotaStore` runs them on its in-process counters; `RedisQuotaStore` runs their Lua
twins inside Redis (gateway/quotas/lua/: `window`, `refusal` and the month in admit.lua,
`settle_bucket` in settle.lua) and builds its `Decision` with `decide` and `merge` from here, so
both answer with the same numbers and headers (the shared suite tests/unit/gateway/test_quotas.py
holds both to them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from gateway.quotas.store import WINDOW_S, Decision, Limits, Reason, Ticket

CONCURRENCY_RETRY_S = 1.0  # what Retry-After says when only the concurrency limit refused


_last_month = (0, 0, 0)  # (first epoch second, first second of the next month, YYYYMM) last computed


def utc_month(second: float) -> int:
    """The UTC calendar month of an epoch second, as YYYYMM."""
    global _last_month
    whole = math.floor(second)
    first, following, month = _last_month  # one tuple: threads see the old span or the new, whole
    if first <= whole < following:
        return month
    when = datetime.fromtimestamp(whole, UTC)
    start = datetime(when.year, when.month, 1, tzinfo=UTC)
    after = datetime(when.year + when.month // 12, when.month % 12 + 1, 1, tzinfo=UTC)
    month = when.year * 100 + when.month
    _last_month = (int(start.timestamp()), int(after.timestamp()), month)
    return month


def previous_month(month: int) -> int:
    """The month before YYYYMM."""
    return month - 89 if month % 100 == 1 else month - 1


def check_admission(scope: str, reserve_tokens: int) -> None:
    """Arguments every store refuses alike. Scopes go into Redis hash tags, so braces would split a
    scope's keys across cluster slots."""
    if not scope or "{" in scope or "}" in scope:
        raise ValueError(f"a quota scope must be non-empty and without braces: {scope!r}")
    if reserve_tokens < 0:
        raise ValueError("reserve_tokens must be >= 0")


@dataclass(frozen=True)
class Usage:
    """What a store observed of one scope at admission, before charging (same fields in Lua)."""

    now: float
    second: int
    month: int
    requests_used: int  # in the window
    requests_wait_s: float  # until one more request fits: 0 fits now, -1 never
    requests_newest: int  # newest window bucket holding requests, -1 for none
    tokens_used: int
    tokens_wait_s: float
    tokens_newest: int
    concurrent: int  # live leases
    budget_spent: int  # this month


def window(buckets: dict[int, int], now: float, extra: int, limit: int | None) -> tuple[int, float, int]:
    """Drop buckets out of the window; return (used, wait until `extra` more fits, newest bucket).

    The wait is 0 when it fits now and -1 when it never can (`extra > limit`). The Lua admit script
    (gateway/quotas/lua/admit.lua) computes exactly this."""
    # Every admission scans up to WINDOW_S buckets: the common cases (nothing out of the window, no
    # bucket refunded to 0) are found by min/max in C before any loop in Python.
    oldest = math.floor(now) - WINDOW_S + 1
    if buckets and min(buckets) < oldest:
        for second in [s for s in buckets if s < oldest]:
            del buckets[second]
    used = sum(buckets.values())
    if not buckets:
        newest = -1
    elif min(buckets.values()) > 0:
        newest = max(buckets)
    else:
        newest = max((s for s, n in buckets.items() if n > 0), default=-1)
    if limit is None or used + extra <= limit:
        return used, 0.0, newest
    left = used
    for second in sorted(buckets):
        left -= buckets[second]
        if left + extra <= limit:
            return used, second + WINDOW_S - now, newest
    return used, -1.0, newest


def refusal(limits: Limits, reserve: int, usage: Usage) -> Reason | None:
    """The first limit that refuses this admission (the Lua admit script applies the same test)."""
    if limits.monthly_token_budget is not None and usage.budget_spent + reserve > limits.monthly_token_budget:
        return "budget"
    if limits.tpm is not None and reserve > limits.tpm:
        return "tpm"  # first: it can never fit, whatever else also refuses
    if limits.rpm is not None and usage.requests_used + 1 > limits.rpm:
        return "rpm"
    if limits.tpm is not None and usage.tokens_used + reserve > limits.tpm:
        return "tpm"
    if limits.max_concurrent is not None and usage.concurrent >= limits.max_concurrent:
        return "concurrency"
    return None


def decide(limits: Limits, reserve: int, usage: Usage, ticket: Ticket | None) -> Decision:
    """The Decision for `usage` (observed before charging); `ticket` is set when it was admitted."""
    rpm, tpm = limits.rpm, limits.tpm
    reset = usage.second + WINDOW_S - usage.now  # after charging, the newest bucket is this second
    if ticket is not None:
        return Decision(
            admitted=True, ticket=ticket,
            limit_requests=rpm, remaining_requests=None if rpm is None else max(0, rpm - usage.requests_used - 1),
            reset_requests_s=None if rpm is None else reset,
            limit_tokens=tpm, remaining_tokens=None if tpm is None else max(0, tpm - usage.tokens_used - reserve),
            reset_tokens_s=None if tpm is None else reset,
        )
    reason = refusal(limits, reserve, usage)
    waits: list[float] = []
    if rpm is not None and usage.requests_used + 1 > rpm:
        waits.append(usage.requests_wait_s)
    if tpm is not None and usage.tokens_used + reserve > tpm:
        waits.append(usage.tokens_wait_s)
    if limits.max_concurrent is not None and usage.concurrent >= limits.max_concurrent:
        waits.append(CONCURRENCY_RETRY_S if limits.max_concurrent > 0 else -1.0)
    # Waiting cannot help: the budget is gone for the month, or some limit can never be met.
    should_retry = reason != "budget" and all(w >= 0 for w in waits)
    return Decision(
        admitted=False, reason=reason, should_retry=should_retry,
        retry_after_s=max(waits, default=0.0) if should_retry else None,
        limit_requests=rpm, remaining_requests=None if rpm is None else max(0, rpm - usage.requests_used),
        reset_requests_s=None if rpm is None else _reset(usage.requests_newest, usage.now),
        limit_tokens=tpm, remaining_tokens=None if tpm is None else max(0, tpm - usage.tokens_used),
        reset_tokens_s=None if tpm is None else _reset(usage.tokens_newest, usage.now),
    )


def merge(tenant: Decision, key: Decision) -> Decision:
    """One decision from a tenant's and its key's (decided on the same observation): refused if
    either refuses (the tenant's reason first), and per dimension the headers of whichever leaves
    less. A decision without a ticket and without a reason refused nothing itself."""
    if not tenant.admitted and tenant.reason is not None:
        return tenant
    if not key.admitted and key.reason is not None:
        return key

    def tighter(a: int | None, b: int | None) -> bool:  # is b's remaining the smaller one?
        return b is not None and (a is None or b < a)

    out = tenant
    if tighter(tenant.remaining_requests, key.remaining_requests):
        out = replace(out, limit_requests=key.limit_requests, remaining_requests=key.remaining_requests,
                      reset_requests_s=key.reset_requests_s)
    if tighter(tenant.remaining_tokens, key.remaining_tokens):
        out = replace(out, limit_tokens=key.limit_tokens, remaining_tokens=key.remaining_tokens,
                      reset_tokens_s=key.reset_tokens_s)
    return out


def _reset(newest: int, now: float) -> float:
    return 0.0 if newest < 0 else max(0.0, newest + WINDOW_S - now)


def settle_bucket(buckets: Mapping[int, int], ticket: Ticket, delta: int, now: float) -> tuple[int, int] | None:
    """Where a tpm correction goes: (bucket, delta) or None to drop it (see the module docstring)."""
    current = math.floor(now)
    if ticket.second > current - WINDOW_S and ticket.second in buckets:
        return ticket.second, delta
    if delta > 0:
        return current, delta
    return None
