"""Per-tenant quotas: the store interface, its decisions, and the rules both stores share.

A scope (a tenant, or one of its keys) gets up to four limits (`Limits`): requests per minute,
tokens per minute, concurrent requests, and a monthly token budget. `QuotaStore.admit` checks and
charges all of them at once; `QuotaStore.settle` ends the request (frees its concurrency slot and
corrects the reserved tokens to the ones actually used).

Semantics every store implements (the shared suite tests/unit/gateway/test_quotas.py runs against each):

- rpm and tpm count over a sliding 60 s window of whole-second buckets: a request admitted during
  second `s` counts until time `s + 60`. A burst of 400 at rpm=100 admits exactly 100, and the next
  is admitted once the oldest admitted second leaves the window.
- tokens are reserved at admission (prompt + max_tokens) in the admission second's bucket; settle
  moves that bucket (and the month's budget) by `actual - reserved`, which may be negative or
  positive. If the bucket has already left the window, only an excess is charged, to the current
  second. Counters never go below zero.
- concurrency is a set of request ids, each with a lease (default 600 s) so that slots held by a
  crashed gateway free themselves.
- the budget is per UTC calendar month: reserved + settled tokens of the month <= budget.
- one admission is atomic: every counter is charged, or none is. Usage is counted even for
  dimensions without a limit (so a limit set later starts from the real usage).
- settle a ticket exactly once; request ids must be unique among running requests of a scope.
- a key's own rpm / tpm (`KeyScope`) are counted on the key, inside its tenant's scope, and checked
  in the same atomic admission as the tenant's limits: the tighter one refuses, and the headers
  show whichever leaves less.
- the month's budget counter is *seeded* before the first admission of a scope in a month, when
  the store has a `BudgetSource` (the gateway's reads usage_events and the usage spool): so a
  budget spent before a restart of the gateway, or before Redis lost its keys, stays spent. A
  source that fails refuses scopes with a budget (QuotaUnavailable) and lets the others through.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Literal, Protocol

WINDOW_S = 60  # rpm / tpm window, in one-second buckets
DEFAULT_LEASE_S = 600.0  # a concurrency slot is reclaimed this long after admission
CONCURRENCY_RETRY_S = 1.0  # what Retry-After says when only the concurrency limit refused

Reason = Literal["rpm", "tpm", "concurrency", "budget"]


BudgetSource = Callable[[str, int], Awaitable[int | None]]
"""(scope, YYYYMM) -> tokens the scope spent in that month before this store knew of it, or None
when the scope has no such record (a scope that is not a tenant)."""


class QuotaUnavailable(Exception):
    """The quota store cannot be reached and the policy is to refuse (fail-closed)."""


@dataclass(frozen=True)
class Limits:
    """A scope's limits; None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    monthly_token_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent", "monthly_token_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, not {value!r}")


@dataclass(frozen=True)
class KeyScope:
    """A key's own rpm / tpm within its tenant's scope (None = only the tenant's limits apply)."""

    name: str  # e.g. "key:12": its counters live under the tenant scope (one Redis hash tag)
    rpm: int | None = None
    tpm: int | None = None

    @property
    def limits(self) -> Limits:
        return Limits(rpm=self.rpm, tpm=self.tpm)


@dataclass(frozen=True)
class Ticket:
    """What `settle` needs to undo or correct an admission."""

    scope: str
    request_id: str
    reserved_tokens: int
    second: int  # the rpm/tpm bucket (epoch second) the request was charged to
    month: int  # the budget month it was charged to, as YYYYMM (UTC)
    holds_slot: bool  # whether it holds a concurrency slot (only when max_concurrent is set)
    origin: str = ""  # the store that issued it ("local" / "redis"): settle goes back there
    key: str | None = None  # the KeyScope it was also charged to


@dataclass(frozen=True)
class Decision:
    """The answer to one admission, with the numbers behind the OpenAI rate-limit headers."""

    admitted: bool
    reason: Reason | None = None
    retry_after_s: float | None = None  # None when waiting cannot help (should_retry False)
    should_retry: bool = True
    ticket: Ticket | None = None
    limit_requests: int | None = None  # None: unlimited, header omitted
    remaining_requests: int | None = None
    reset_requests_s: float | None = None  # until the window holds no request again
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None

    def headers(self) -> dict[str, str]:
        """The response headers: `x-ratelimit-*` always (limited dimensions only), plus `retry-after`
        on a retryable rejection and `x-should-retry: false` when waiting cannot help."""
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests or 0)
            out["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s or 0.0)
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens or 0)
            out["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s or 0.0)
        if not self.admitted:
            if self.should_retry and self.retry_after_s is not None:
                out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            if not self.should_retry:
                out["x-should-retry"] = "false"
        return out

    @property
    def error_type(self) -> str | None:
        """OpenAI's error `type` for a rejection (also its `code`): budget gone, or rate limited."""
        if self.admitted:
            return None
        return "insufficient_quota" if self.reason == "budget" else "rate_limit_error"

    @property
    def message(self) -> str:
        """A human-readable reason for a rejection."""
        what = {
            "rpm": f"requests per minute (limit {self.limit_requests})",
            "tpm": f"tokens per minute (limit {self.limit_tokens})",
            "concurrency": "concurrent requests",
            "budget": "the monthly token budget",
        }.get(self.reason or "", "quota")
        if self.reason == "budget":
            return f"You exceeded {what}; check your plan."
        if not self.should_retry:
            return f"This request can never fit the limit on {what}."
        return f"Rate limit reached for {what}. Please try again in {format_duration(self.retry_after_s or 0)}."


class QuotaStore(Protocol):
    """Where quota counters live (in-process, or Redis shared by every gateway replica)."""

    async def admit(
        self, scope: str, limits: Limits, request_id: str, reserve_tokens: int, now: float | None = None,
        key: KeyScope | None = None,
    ) -> Decision:
        """Check every limit of `scope` (and of `key`) and, only if all pass, charge them all atomically.

        `now` (epoch seconds) is for tests; None means the store's clock."""
        ...

    async def settle(self, ticket: Ticket, actual_tokens: int, now: float | None = None) -> None:
        """End an admitted request: free its slot, correct reserved tokens to `actual_tokens`."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def format_duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format at millisecond precision: `20ms`, `1s`, `6.5s`, `6m0s`, `1h0m0s`."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, frac = divmod(rest, 1000)
    sec_text = f"{secs}.{frac:03d}".rstrip("0") if frac else str(secs)
    if hours:
        return f"{hours}h{minutes}m{sec_text}s"
    if minutes:
        return f"{minutes}m{sec_text}s"
    return f"{sec_text}s"


def utc_month(second: float) -> int:
    """The UTC calendar month of an epoch second, as YYYYMM."""
    when = datetime.fromtimestamp(math.floor(second), UTC)
    return when.year * 100 + when.month


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

    The wait is 0 when it fits now and -1 when it never can (`extra > limit`). The Lua scripts of
    quota_redis.py compute exactly this."""
    oldest = math.floor(now) - WINDOW_S + 1
    for second in [s for s in buckets if s < oldest]:
        del buckets[second]
    used = sum(buckets.values())
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
