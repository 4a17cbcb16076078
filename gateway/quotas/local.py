"""The in-process quota store: one gateway process (`tollway up`), or the fail-open fallback.

Atomicity comes from asyncio: `admit` and `settle` contain no `await` between reading and charging
the counters, so on the event loop's single thread no other admission can interleave with one.
Hence no locks. (Do not call them from other threads.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from gateway.quotas.rules import (
    Usage,
    check_admission,
    decide,
    merge,
    previous_month,
    refusal,
    settle_bucket,
    utc_month,
    window,
)
from gateway.quotas.store import (
    DEFAULT_LEASE_S,
    BudgetSource,
    Decision,
    KeyScope,
    Limits,
    QuotaUnavailable,
    Ticket,
)


@dataclass
class _ScopeState:
    requests: dict[int, int] = field(default_factory=dict)  # epoch second -> requests admitted
    tokens: dict[int, int] = field(default_factory=dict)  # epoch second -> tokens charged
    leases: dict[str, float] = field(default_factory=dict)  # request id -> lease expiry
    budget: dict[int, int] = field(default_factory=dict)  # YYYYMM -> tokens charged


class LocalQuotaStore:
    """Quotas kept in this process's memory, with the semantics of `gateway.quotas.store`."""

    origin = "local"

    def __init__(self, lease_s: float = DEFAULT_LEASE_S, budget_source: BudgetSource | None = None) -> None:
        self._lease_s = lease_s
        self._scopes: dict[str, _ScopeState] = {}
        self._budget_source = budget_source
        self._seeded: set[tuple[str, int]] = set()  # (scope, month) whose budget counter holds the past

    async def admit(
        self, scope: str, limits: Limits, request_id: str, reserve_tokens: int, now: float | None = None,
        key: KeyScope | None = None, budget_only: bool = False,
    ) -> Decision:
        """Check and charge every limit of `scope` (and `key`) at once (`budget_only`: the budget alone).
        The only await is the month's budget seeding, before any counter is read: what follows is atomic
        on the loop."""
        check_admission(scope, reserve_tokens)
        now = time.time() if now is None else now
        second = math.floor(now)
        month = utc_month(second)
        if self._budget_source is not None and (scope, month) not in self._seeded:
            await self._seed(scope, month, limits)
        state = self._scopes.setdefault(scope, _ScopeState())
        for lease_id in [i for i, expiry in state.leases.items() if expiry <= now]:
            del state.leases[lease_id]
        usage = self._usage(state, now, reserve_tokens, limits, concurrent=len(state.leases),
                            budget_spent=state.budget.get(month, 0))
        key_state = self._scopes.setdefault(f"{scope}:{key.name}", _ScopeState()) if key is not None else None
        key_usage = (self._usage(key_state, now, reserve_tokens, key.limits, concurrent=0, budget_spent=0)
                     if key is not None and key_state is not None else None)
        refused = refusal(limits, reserve_tokens, usage) is not None or (
            key is not None and key_usage is not None and refusal(key.limits, reserve_tokens, key_usage) is not None)
        ticket = None
        if not refused:
            windowed = () if budget_only else (state, key_state)  # whose rpm / tpm windows are charged
            for charged in windowed:
                if charged is not None:
                    charged.requests[second] = charged.requests.get(second, 0) + 1
                    charged.tokens[second] = charged.tokens.get(second, 0) + reserve_tokens
            state.budget[month] = state.budget.get(month, 0) + reserve_tokens
            # Keep this month and the last (a ticket admitted before the rollover may still settle).
            for old in [m for m in state.budget if m < previous_month(month)]:
                del state.budget[old]
            holds_slot = limits.max_concurrent is not None and not budget_only
            if holds_slot:
                state.leases[request_id] = now + self._lease_s
            ticket = Ticket(scope, request_id, reserve_tokens, second, month, holds_slot, self.origin,
                            key.name if key is not None else None, budget_only)
        decision = decide(limits, reserve_tokens, usage, ticket)
        if key is not None and key_usage is not None:
            decision = merge(decision, decide(key.limits, reserve_tokens, key_usage, ticket))
        return decision

    @staticmethod
    def _usage(state: _ScopeState, now: float, reserve_tokens: int, limits: Limits, *, concurrent: int,
               budget_spent: int) -> Usage:
        second = math.floor(now)
        requests_used, requests_wait, requests_newest = window(state.requests, now, 1, limits.rpm)
        tokens_used, tokens_wait, tokens_newest = window(state.tokens, now, reserve_tokens, limits.tpm)
        return Usage(
            now=now, second=second, month=utc_month(second),
            requests_used=requests_used, requests_wait_s=requests_wait, requests_newest=requests_newest,
            tokens_used=tokens_used, tokens_wait_s=tokens_wait, tokens_newest=tokens_newest,
            concurrent=concurrent, budget_spent=budget_spent,
        )

    async def _seed(self, scope: str, month: int, limits: Limits) -> None:
        """Add what the scope spent this month before this process (usage_events + spool)."""
        assert self._budget_source is not None
        try:
            spent = await self._budget_source(scope, month)
        except Exception as exc:
            if limits.monthly_token_budget is not None:  # cannot know what is left: refuse, retry later
                raise QuotaUnavailable(f"the month's spend of {scope} cannot be read") from exc
            return  # nothing to enforce: admit now, seed on a later admission
        if (scope, month) in self._seeded:  # a concurrent admission seeded it meanwhile
            return
        self._seeded.add((scope, month))
        if spent:
            state = self._scopes.setdefault(scope, _ScopeState())
            state.budget[month] = state.budget.get(month, 0) + spent

    async def settle(self, ticket: Ticket, actual_tokens: int, now: float | None = None) -> None:
        """Free the ticket's slot and move its tokens from reserved to `actual_tokens`."""
        now = time.time() if now is None else now
        state = self._scopes.get(ticket.scope)
        if state is None:
            return
        if ticket.holds_slot:
            state.leases.pop(ticket.request_id, None)
        delta = actual_tokens - ticket.reserved_tokens
        if delta == 0:
            return
        key_state = self._scopes.get(f"{ticket.scope}:{ticket.key}") if ticket.key is not None else None
        windowed = () if ticket.budget_only else (state, key_state)
        for charged in windowed:
            if charged is None:
                continue
            window(charged.tokens, now, 0, None)  # prune, so that a bucket out of the window is not revived
            target = settle_bucket(charged.tokens, ticket, delta, now)
            if target is not None:
                second, change = target
                charged.tokens[second] = max(0, charged.tokens.get(second, 0) + change)
        if ticket.month in state.budget:
            state.budget[ticket.month] = max(0, state.budget[ticket.month] + delta)

    async def close(self) -> None:
        """Nothing to release."""
        self._scopes.clear()
