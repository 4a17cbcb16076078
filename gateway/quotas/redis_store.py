"""Quotas in Redis, shared by every gateway replica.

Key layout (all keys of a scope share the hash tag `{scope}`, so Redis Cluster keeps them in one
slot and one Lua script may touch them all):

    {prefix}:{scope}:rq      hash   epoch second -> requests admitted     (TTL 120 s, refreshed)
    {prefix}:{scope}:tk      hash   epoch second -> tokens charged        (TTL 120 s, refreshed)
    {prefix}:{scope}:lease   zset   request id -> lease expiry (epoch s)  (TTL lease + 60 s, refreshed)
    {prefix}:{scope}:budget  hash   YYYYMM (UTC) -> tokens charged        (TTL 70 days, refreshed)
    {prefix}:{scope}:seeded  hash   YYYYMM -> 1: the month's counter holds usage_events' spend (TTL 70 days)
    {prefix}:{scope}:key:N:rq / :key:N:tk   a key's own rpm / tpm windows, as rq / tk

Each admission is ONE Lua script (check everything, then charge everything or nothing), each
settle another; Redis runs a script atomically, so N gateway processes never over-admit. With a
budget source, an admission in a month the `seeded` hash does not name (the first of the month,
or after Redis lost its keys) first seeds the month's counter (another script, once), then runs.
The scripts are Lua files beside this module (`lua/`, package data in pyproject.toml).

Time source: the caller's `now` when given (tests slide the window with it), else the Redis
server's clock (`TIME` inside the script), never the gateway's: replicas with skewed clocks still
agree on the window and the month. Within one deployment, use one or the other consistently.
(Scripts calling TIME before writing need effect replication: the default since Redis 5.)

Connections make no blind retries: an admission whose reply was lost may already be charged,
and retrying it would charge twice. Connection errors reach `gateway.quotas.failover` instead.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript

from gateway.quotas.rules import Usage, check_admission, decide, merge
from gateway.quotas.store import (
    DEFAULT_LEASE_S,
    WINDOW_S,
    BudgetSource,
    Decision,
    KeyScope,
    Limits,
    QuotaUnavailable,
    Ticket,
)

_SCRIPTS = Path(__file__).with_name("lua")


def _lua(*names: str) -> str:
    """The Lua files `names` of gateway/quotas/lua/, joined into one script."""
    return "".join((_SCRIPTS / f"{name}.lua").read_text(encoding="utf-8") for name in names)


# The admit and settle scripts start with the prelude that reads the time and the window.
ADMIT_LUA = _lua("prelude", "admit")
SEED_LUA = _lua("seed")
SETTLE_LUA = _lua("prelude", "settle")

# What counts as "Redis is unreachable" (anything else, e.g. a script error, is a bug and propagates).
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError, asyncio.TimeoutError)


def _arg(limit: int | None) -> int:
    return -1 if limit is None else limit


class RedisQuotaStore:
    """Quotas in Redis with the semantics of `gateway.quotas.store` (no connection until first use)."""

    origin = "redis"

    def __init__(
        self, redis_url: str, prefix: str = "tollway", *, lease_s: float = DEFAULT_LEASE_S, timeout_s: float = 1.0,
        connect_timeout_s: float = 3.5, max_connections: int = 50, pool_timeout_s: float = 5.0,
        budget_source: BudgetSource | None = None,
    ) -> None:
        self.prefix = prefix
        self._lease_s = lease_s
        self._budget_source = budget_source
        # A bounded pool that queues callers (a burst of admissions waits for a connection rather
        # than failing); waiting longer than `pool_timeout_s` counts as Redis being unreachable.
        # The queue is `_slots` (FIFO, wakes one waiter per release), so the pool itself never has
        # waiters: its own wait (a condition lock and a timeout per caller) cost the gateway ~0.4 ms
        # of CPU per request with 256 clients (ops/bench/RESULTS.md).
        # Connecting gets longer than a command: a burst opens up to `max_connections` sockets at
        # once, and a SYN that a busy Redis's accept queue drops is resent by the kernel 1 s later
        # and again 2 s after that; a 1 s connect timeout turned one dropped SYN into a failover
        # (seen on CI). A Redis that is down refuses at once: the failover is no slower for it.
        self._slots = asyncio.Semaphore(max_connections)
        self._pool_timeout_s = pool_timeout_s
        pool = redis.BlockingConnectionPool.from_url(
            redis_url, max_connections=max_connections, timeout=pool_timeout_s,
            socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s, retry=Retry(NoBackoff(), 0),
        )
        self.client = redis.Redis(connection_pool=pool)
        self._admit = self.client.register_script(ADMIT_LUA)
        self._settle = self.client.register_script(SETTLE_LUA)
        self._seed = self.client.register_script(SEED_LUA)

    def key(self, scope: str, name: str) -> str:
        """The Redis key of one counter of `scope` (`rq`, `tk`, `lease` or `budget`)."""
        return f"{self.prefix}:{{{scope}}}:{name}"

    async def admit(
        self, scope: str, limits: Limits, request_id: str, reserve_tokens: int, now: float | None = None,
        key: KeyScope | None = None, budget_only: bool = False,
    ) -> Decision:
        """Check and charge every limit of `scope` (and `key`) in one Lua script (atomic across
        replicas); first, once per month and scope, seed the month's budget counter. `budget_only`:
        the budget alone (the store's module says)."""
        check_admission(scope, reserve_tokens)
        key_name = key.name if key is not None else "-"
        keys = [self.key(scope, "rq"), self.key(scope, "tk"), self.key(scope, "lease"), self.key(scope, "budget"),
                self.key(scope, "seeded"), self.key(scope, f"{key_name}:rq"), self.key(scope, f"{key_name}:tk")]
        need_seed = self._budget_source is not None
        args: list[str | int | float] = [
            "" if now is None else repr(float(now)), WINDOW_S, _arg(limits.rpm), _arg(limits.tpm),
            _arg(limits.max_concurrent), _arg(limits.monthly_token_budget), request_id, reserve_tokens, self._lease_s,
            int(need_seed), _arg(key.rpm if key else None), _arg(key.tpm if key else None), int(key is not None),
            int(budget_only),
        ]
        reply = await self._run(self._admit, keys, args)
        if int(reply[0]) == -1:  # the month's budget is unknown here: seed it, then decide
            args[9] = int(await self._seed_month(scope, int(reply[1]), limits))
            reply = await self._run(self._admit, keys, args)
        (admitted, t, second, month, r_used, r_wait, r_newest, t_used, t_wait, t_newest, conc, spent, holds,
         kr_used, kr_wait, kr_newest, kt_used, kt_wait, kt_newest) = reply
        usage = Usage(
            now=float(t), second=int(second), month=int(month),
            requests_used=int(r_used), requests_wait_s=float(r_wait), requests_newest=int(r_newest),
            tokens_used=int(t_used), tokens_wait_s=float(t_wait), tokens_newest=int(t_newest),
            concurrent=int(conc), budget_spent=int(spent),
        )
        ticket = None
        if int(admitted):
            ticket = Ticket(scope, request_id, reserve_tokens, usage.second, usage.month, bool(int(holds)), self.origin,
                            key.name if key is not None else None, budget_only)
        decision = decide(limits, reserve_tokens, usage, ticket)
        if key is not None:
            key_usage = replace(usage, requests_used=int(kr_used), requests_wait_s=float(kr_wait),
                                requests_newest=int(kr_newest), tokens_used=int(kt_used),
                                tokens_wait_s=float(kt_wait), tokens_newest=int(kt_newest), concurrent=0,
                                budget_spent=0)
            decision = merge(decision, decide(key.limits, reserve_tokens, key_usage, ticket))
        return decision

    async def _seed_month(self, scope: str, month: int, limits: Limits) -> bool:
        """Seed the month's budget counter from the budget source; whether admission must still
        require a seeded month (False: the source failed for a scope without a budget, admit anyway)."""
        assert self._budget_source is not None
        try:
            spent = await self._budget_source(scope, month)
        except Exception as exc:
            if limits.monthly_token_budget is not None:
                raise QuotaUnavailable(f"the month's spend of {scope} cannot be read") from exc
            return False
        await self._run(self._seed, [self.key(scope, "seeded"), self.key(scope, "budget")], [month, spent or 0])
        return True

    async def settle(self, ticket: Ticket, actual_tokens: int, now: float | None = None) -> None:
        """Free the ticket's slot and move its tokens from reserved to `actual_tokens` (one script)."""
        key_name = ticket.key or "-"
        keys = [self.key(ticket.scope, "tk"), self.key(ticket.scope, "lease"), self.key(ticket.scope, "budget"),
                self.key(ticket.scope, f"{key_name}:tk")]
        args: list[str | int | float] = [
            "" if now is None else repr(float(now)), WINDOW_S, ticket.request_id,
            actual_tokens - ticket.reserved_tokens, ticket.second, ticket.month, int(ticket.holds_slot),
            int(ticket.key is not None), int(ticket.budget_only),
        ]
        await self._run(self._settle, keys, args)

    async def _run(self, script: AsyncScript, keys: list[str], args: list[str | int | float]) -> Any:
        """Run `script` once a connection is free (raises TimeoutError after `pool_timeout_s`)."""
        async with asyncio.timeout(self._pool_timeout_s):
            await self._slots.acquire()
        try:
            return await script(keys=keys, args=args)
        finally:
            self._slots.release()

    async def close(self) -> None:
        """Close the connection pool."""
        await self.client.aclose(close_connection_pool=True)
