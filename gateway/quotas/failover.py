"""The policy for when the Redis quota store is unreachable: fail open on local counters, or closed.

`RedisQuotaStore` makes no blind retries: its connection errors (`CONNECTION_ERRORS`; anything
else, e.g. a script error, is a bug and propagates) come here, to `FailoverQuotaStore`, the store
the gateway uses with Redis. It decides what admissions get while Redis is down, and when Redis is
tried again.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Literal

from gateway.quotas.local import LocalQuotaStore
from gateway.quotas.redis_store import CONNECTION_ERRORS, RedisQuotaStore
from gateway.quotas.store import Decision, KeyScope, Limits, QuotaUnavailable, Ticket

log = logging.getLogger("tollway.gateway.quotas")


class FailoverQuotaStore:
    """Redis first; when it is unreachable, a policy instead of an outage.

    - mode "open": admissions are answered by `fallback` (this process's own counters, so with N
      replicas a scope may get up to N times its limits while Redis is down);
    - mode "closed": admissions raise `QuotaUnavailable` (the gateway answers 503).

    After a connection error Redis is not tried for `retry_after_s`; the next admission after that
    tries it again and, if it answers, everything is back on Redis (no restart needed). Tickets
    settle with the store that issued them. A settle that cannot reach Redis is dropped with a
    warning in both modes: the reservation stays charged (usually an over-count) and the slot's
    lease frees it later.
    """

    def __init__(
        self, primary: RedisQuotaStore, fallback: LocalQuotaStore, mode: Literal["open", "closed"] = "open",
        retry_after_s: float = 1.0,
    ) -> None:
        if mode not in ("open", "closed"):
            raise ValueError(f"mode must be 'open' or 'closed', not {mode!r}")
        self.primary = primary
        self.fallback = fallback
        self.mode = mode
        self.retry_after_s = retry_after_s
        self._down_until = -math.inf  # time.monotonic() before which Redis is not tried

    @property
    def degraded(self) -> bool:
        """Whether Redis is currently considered unreachable."""
        return time.monotonic() < self._down_until

    def _mark_down(self, exc: BaseException) -> None:
        if not self.degraded:
            log.warning("quota store unreachable (%r); failing %s for %.1f s", exc, self.mode, self.retry_after_s)
        self._down_until = time.monotonic() + self.retry_after_s

    async def admit(
        self, scope: str, limits: Limits, request_id: str, reserve_tokens: int, now: float | None = None,
        key: KeyScope | None = None, budget_only: bool = False,
    ) -> Decision:
        """Admit on Redis, or by the policy while Redis is unreachable."""
        if not self.degraded:
            try:
                decision = await self.primary.admit(scope, limits, request_id, reserve_tokens, now, key, budget_only)
            except CONNECTION_ERRORS as exc:
                self._mark_down(exc)
            else:
                if self._down_until != -math.inf:
                    log.warning("quota store reachable again")
                    self._down_until = -math.inf
                return decision
        if self.mode == "closed":
            raise QuotaUnavailable("the quota store is unreachable")
        return await self.fallback.admit(scope, limits, request_id, reserve_tokens, now, key, budget_only)

    async def settle(self, ticket: Ticket, actual_tokens: int, now: float | None = None) -> None:
        """Settle with the store that issued the ticket."""
        if ticket.origin == self.fallback.origin:
            await self.fallback.settle(ticket, actual_tokens, now)
            return
        try:
            await self.primary.settle(ticket, actual_tokens, now)
        except CONNECTION_ERRORS as exc:
            log.warning("could not settle %s on the quota store (%r); its lease frees the slot", ticket.request_id, exc)
            self._mark_down(exc)

    async def close(self) -> None:
        """Close both stores."""
        await self.primary.close()
        await self.fallback.close()
