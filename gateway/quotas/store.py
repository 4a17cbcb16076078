"""Per-tenant quotas: the store interface and its decisions (the rules both stores share: `rules.py`).

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
- a *budget-only* admission (`budget_only=True`: a batch line, which the interactive rpm / tpm /
  concurrency do not govern) checks and charges the month's budget alone: no window counter moves,
  no slot is held, and its settle corrects the budget only.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

WINDOW_S = 60  # rpm / tpm window, in one-second buckets
DEFAULT_LEASE_S = 600.0  # a concurrency slot is reclaimed this long after admission

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
    budget_only: bool = False  # charged to the month's budget alone (a batch line): settle leaves the windows


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
        key: KeyScope | None = None, budget_only: bool = False,
    ) -> Decision:
        """Check every limit of `scope` (and of `key`) and, only if all pass, charge them all atomically
        (`budget_only`: the month's budget alone, as the module says).

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
