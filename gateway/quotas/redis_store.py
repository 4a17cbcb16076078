"""Quotas in Redis, shared by every gateway replica, and the policy for when Redis is unreachable.

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

Time source: the caller's `now` when given (tests slide the window with it), else the Redis
server's clock (`TIME` inside the script), never the gateway's: replicas with skewed clocks still
agree on the window and the month. Within one deployment, use one or the other consistently.
(Scripts calling TIME before writing need effect replication: the default since Redis 5.)

Connections make no blind retries: an admission whose reply was lost may already be charged,
and retrying it would charge twice. Connection errors reach `FailoverQuotaStore` instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace
from typing import Any, Literal

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript

from gateway.quotas.local import LocalQuotaStore
from gateway.quotas.store import (
    DEFAULT_LEASE_S,
    WINDOW_S,
    BudgetSource,
    Decision,
    KeyScope,
    Limits,
    QuotaUnavailable,
    Ticket,
    Usage,
    check_admission,
    decide,
    merge,
)

log = logging.getLogger("tollway.gateway.quotas")

# The same rules as gateway.quotas.store.window / refusal (the shared test suite holds both to them).
_PRELUDE = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local sec = math.floor(now)
local win = tonumber(ARGV[2])
"""

ADMIT_LUA = _PRELUDE + """
-- KEYS: requests hash, tokens hash, leases zset, budget hash, seeded-months hash, the key's requests
-- and tokens hashes. ARGV[3..]: rpm, tpm, max_concurrent, budget (-1 = unlimited), request id,
-- reserve, lease seconds, require a seeded month (1/0), key rpm, key tpm, has a key (1/0).
local rpm, tpm, maxc, budget = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local rid, reserve, lease = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local need_seed, key_rpm, key_tpm, has_key = ARGV[10] == '1', tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[13] == '1'

local function window(key, extra, limit)
  local flat = redis.call('HGETALL', key)
  local buckets, stale, used, newest = {}, {}, 0, -1
  for i = 1, #flat, 2 do
    local s, n = tonumber(flat[i]), tonumber(flat[i + 1])
    if s <= sec - win then
      stale[#stale + 1] = flat[i]
    else
      buckets[#buckets + 1] = {s, n}
      used = used + n
      if n > 0 and s > newest then newest = s end
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  if limit < 0 or used + extra <= limit then return used, 0, newest end
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  local left = used
  for _, b in ipairs(buckets) do
    left = left - b[2]
    if left + extra <= limit then return used, b[1] + win - now, newest end
  end
  return used, -1, newest
end

-- UTC YYYYMM of an epoch second (civil_from_days, H. Hinnant).
local function month_of(s)
  local z = math.floor(s / 86400) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y * 100 + m
end

local month = month_of(sec)
if need_seed and redis.call('HEXISTS', KEYS[5], month) == 0 then
  return {-1, month}  -- the month's spend is not known here yet (first use, or Redis lost its keys)
end
local r_used, r_wait, r_newest = window(KEYS[1], 1, rpm)
local t_used, t_wait, t_newest = window(KEYS[2], reserve, tpm)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', string.format('%.17g', now))
local conc = redis.call('ZCARD', KEYS[3])
local spent = tonumber(redis.call('HGET', KEYS[4], month) or '0')
local kr_used, kr_wait, kr_newest, kt_used, kt_wait, kt_newest = 0, 0, -1, 0, 0, -1
if has_key then
  kr_used, kr_wait, kr_newest = window(KEYS[6], 1, key_rpm)
  kt_used, kt_wait, kt_newest = window(KEYS[7], reserve, key_tpm)
end

local refused = (budget >= 0 and spent + reserve > budget) or (rpm >= 0 and r_used + 1 > rpm)
  or (tpm >= 0 and t_used + reserve > tpm) or (maxc >= 0 and conc >= maxc)
  or (has_key and ((key_rpm >= 0 and kr_used + 1 > key_rpm) or (key_tpm >= 0 and kt_used + reserve > key_tpm)))
local holds = 0
if not refused then
  redis.call('HINCRBY', KEYS[1], sec, 1)
  redis.call('EXPIRE', KEYS[1], 2 * win)
  redis.call('HINCRBY', KEYS[2], sec, reserve)
  redis.call('EXPIRE', KEYS[2], 2 * win)
  if has_key then
    redis.call('HINCRBY', KEYS[6], sec, 1)
    redis.call('EXPIRE', KEYS[6], 2 * win)
    redis.call('HINCRBY', KEYS[7], sec, reserve)
    redis.call('EXPIRE', KEYS[7], 2 * win)
  end
  redis.call('HINCRBY', KEYS[4], month, reserve)
  redis.call('EXPIRE', KEYS[4], 70 * 86400)
  local prev = (month % 100 == 1) and (month - 89) or (month - 1)
  for _, m in ipairs(redis.call('HKEYS', KEYS[4])) do
    if tonumber(m) < prev then redis.call('HDEL', KEYS[4], m) end
  end
  if maxc >= 0 then
    redis.call('ZADD', KEYS[3], string.format('%.17g', now + lease), rid)
    redis.call('EXPIRE', KEYS[3], math.ceil(lease) + win)
    holds = 1
  end
end
return {refused and 0 or 1, string.format('%.17g', now), sec, month, r_used, string.format('%.17g', r_wait),
  r_newest, t_used, string.format('%.17g', t_wait), t_newest, conc, spent, holds,
  kr_used, string.format('%.17g', kr_wait), kr_newest, kt_used, string.format('%.17g', kt_wait), kt_newest}
"""

SEED_LUA = """
-- KEYS: seeded-months hash, budget hash. ARGV: month (YYYYMM), tokens spent before (usage_events).
-- Once per month and scope (until Redis loses the keys): concurrent seeders add it only once.
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 1 then
  local spent = tonumber(ARGV[2])
  if spent > 0 then
    redis.call('HINCRBY', KEYS[2], ARGV[1], spent)
    redis.call('EXPIRE', KEYS[2], 70 * 86400)
  end
end
redis.call('EXPIRE', KEYS[1], 70 * 86400)
return 1
"""

SETTLE_LUA = _PRELUDE + """
-- KEYS: tokens hash, leases zset, budget hash, the key's tokens hash. ARGV[3..]: request id, delta,
-- second, month, holds slot, has a key.
if ARGV[7] == '1' then redis.call('ZREM', KEYS[2], ARGV[3]) end
local delta = tonumber(ARGV[4])
if delta == 0 then return 0 end
local function correct(key)
  local target = nil
  if tonumber(ARGV[5]) > sec - win and redis.call('HEXISTS', key, ARGV[5]) == 1 then
    target = ARGV[5]
  elseif delta > 0 then
    target = sec
  end
  if target then
    if redis.call('HINCRBY', key, target, delta) < 0 then redis.call('HSET', key, target, 0) end
    redis.call('EXPIRE', key, 2 * win)
  end
end
correct(KEYS[1])
if ARGV[8] == '1' then correct(KEYS[4]) end
if redis.call('HEXISTS', KEYS[3], ARGV[6]) == 1 then
  if redis.call('HINCRBY', KEYS[3], ARGV[6], delta) < 0 then redis.call('HSET', KEYS[3], ARGV[6], 0) end
end
return 1
"""

# What counts as "Redis is unreachable" (anything else, e.g. a script error, is a bug and propagates).
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError, asyncio.TimeoutError)


def _arg(limit: int | None) -> int:
    return -1 if limit is None else limit


class RedisQuotaStore:
    """Quotas in Redis with the semantics of `gateway.quotas.store` (no connection until first use)."""

    origin = "redis"

    def __init__(
        self, redis_url: str, prefix: str = "tollway", *, lease_s: float = DEFAULT_LEASE_S, timeout_s: float = 1.0,
        max_connections: int = 50, pool_timeout_s: float = 5.0, budget_source: BudgetSource | None = None,
    ) -> None:
        self.prefix = prefix
        self._lease_s = lease_s
        self._budget_source = budget_source
        # A bounded pool that queues callers (a burst of admissions waits for a connection rather
        # than failing); waiting longer than `pool_timeout_s` counts as Redis being unreachable.
        # The queue is `_slots` (FIFO, wakes one waiter per release), so the pool itself never has
        # waiters: its own wait (a condition lock and a timeout per caller) cost the gateway ~0.4 ms
        # of CPU per request with 256 clients (ops/bench/RESULTS.md).
        self._slots = asyncio.Semaphore(max_connections)
        self._pool_timeout_s = pool_timeout_s
        pool = redis.BlockingConnectionPool.from_url(
            redis_url, max_connections=max_connections, timeout=pool_timeout_s,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
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
        key: KeyScope | None = None,
    ) -> Decision:
        """Check and charge every limit of `scope` (and `key`) in one Lua script (atomic across
        replicas); first, once per month and scope, seed the month's budget counter."""
        check_admission(scope, reserve_tokens)
        key_name = key.name if key is not None else "-"
        keys = [self.key(scope, "rq"), self.key(scope, "tk"), self.key(scope, "lease"), self.key(scope, "budget"),
                self.key(scope, "seeded"), self.key(scope, f"{key_name}:rq"), self.key(scope, f"{key_name}:tk")]
        need_seed = self._budget_source is not None
        args: list[str | int | float] = [
            "" if now is None else repr(float(now)), WINDOW_S, _arg(limits.rpm), _arg(limits.tpm),
            _arg(limits.max_concurrent), _arg(limits.monthly_token_budget), request_id, reserve_tokens, self._lease_s,
            int(need_seed), _arg(key.rpm if key else None), _arg(key.tpm if key else None), int(key is not None),
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
                            key.name if key is not None else None)
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
            int(ticket.key is not None),
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
        key: KeyScope | None = None,
    ) -> Decision:
        """Admit on Redis, or by the policy while Redis is unreachable."""
        if not self.degraded:
            try:
                decision = await self.primary.admit(scope, limits, request_id, reserve_tokens, now, key)
            except CONNECTION_ERRORS as exc:
                self._mark_down(exc)
            else:
                if self._down_until != -math.inf:
                    log.warning("quota store reachable again")
                    self._down_until = -math.inf
                return decision
        if self.mode == "closed":
            raise QuotaUnavailable("the quota store is unreachable")
        return await self.fallback.admit(scope, limits, request_id, reserve_tokens, now, key)

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
