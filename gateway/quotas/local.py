"""The in-process quota store: one gateway process (`tollway up`), or the fail-open fallback.

Atomicity comes from asyncio: `admit` and `settle` contain no `await` between reading and charging
the counters, so on the event loop's single thread no other admission can interleave with one.
Hence no locks. (Do not call them from other threads.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from gateway.quotas.store import (
    DEFAULT_LEASE_S,
    Decision,
    Limits,
    Ticket,
    Usage,
    check_admission,
    decide,
    previous_month,
    refusal,
    settle_bucket,
    utc_month,
    window,
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

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self._lease_s = lease_s
        self._scopes: dict[str, _ScopeState] = {}

    async def admit(
        self, scope: str, limits: Limits, request_id: str, reserve_tokens: int, now: float | None = None
    ) -> Decision:
        """Check and charge every limit of `scope` at once (no await inside: atomic on the loop)."""
        check_admission(scope, reserve_tokens)
        now = time.time() if now is None else now
        state = self._scopes.setdefault(scope, _ScopeState())
        second = math.floor(now)
        month = utc_month(second)
        for lease_id in [i for i, expiry in state.leases.items() if expiry <= now]:
            del state.leases[lease_id]
        requests_used, requests_wait, requests_newest = window(state.requests, now, 1, limits.rpm)
        tokens_used, tokens_wait, tokens_newest = window(state.tokens, now, reserve_tokens, limits.tpm)
        usage = Usage(
            now=now, second=second, month=month,
            requests_used=requests_used, requests_wait_s=requests_wait, requests_newest=requests_newest,
            tokens_used=tokens_used, tokens_wait_s=tokens_wait, tokens_newest=tokens_newest,
            concurrent=len(state.leases), budget_spent=state.budget.get(month, 0),
        )
        if refusal(limits, reserve_tokens, usage) is not None:
            return decide(limits, reserve_tokens, usage, None)
        state.requests[second] = state.requests.get(second, 0) + 1
        state.tokens[second] = state.tokens.get(second, 0) + reserve_tokens
        state.budget[month] = state.budget.get(month, 0) + reserve_tokens
        # Keep this month and the last (a ticket admitted before the rollover may still settle).
        for old in [m for m in state.budget if m < previous_month(month)]:
            del state.budget[old]
        holds_slot = limits.max_concurrent is not None
        if holds_slot:
            state.leases[request_id] = now + self._lease_s
        ticket = Ticket(scope, request_id, reserve_tokens, second, month, holds_slot, self.origin)
        return decide(limits, reserve_tokens, usage, ticket)

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
        window(state.tokens, now, 0, None)  # prune, so that a bucket out of the window is not revived
        target = settle_bucket(state.tokens, ticket, delta, now)
        if target is not None:
            second, change = target
            state.tokens[second] = max(0, state.tokens.get(second, 0) + change)
        if ticket.month in state.budget:
            state.budget[ticket.month] = max(0, state.budget[ticket.month] + delta)

    async def close(self) -> None:
        """Nothing to release."""
        self._scopes.clear()
