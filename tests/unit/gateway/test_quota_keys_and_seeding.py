"""Per-key rpm / tpm inside a tenant's limits, and monthly budgets seeded from what was spent
before the store knew of the tenant: one suite for the in-process store and Redis (services)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from gateway.quotas.local import LocalQuotaStore
from gateway.quotas.store import BudgetSource, KeyScope, Limits, QuotaStore, QuotaUnavailable

T0 = 1_750_000_000.0  # 2025-06-15 UTC
JUNE = 202506
pytestmark = pytest.mark.asyncio


class Spent:
    """A budget source: spend per (scope, month), counting its calls; `fail` makes it raise."""

    def __init__(self, spent: dict[tuple[str, int], int]) -> None:
        self.spent, self.calls, self.fail = spent, 0, False

    async def __call__(self, scope: str, month: int) -> int | None:
        self.calls += 1
        if self.fail:
            raise OSError("the database is down")
        return self.spent.get((scope, month), 0) if scope.startswith("tenant:") else None


@pytest_asyncio.fixture(params=["local", pytest.param("redis", marks=pytest.mark.services)])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[BudgetSource | None], QuotaStore]]:
    made: list[QuotaStore] = []
    prefix = f"test-quota-seed-{uuid.uuid4().hex}"

    def make(source: BudgetSource | None) -> QuotaStore:
        if request.param == "local":
            store: QuotaStore = LocalQuotaStore(budget_source=source)
        else:
            from gateway.quotas.redis_store import RedisQuotaStore

            store = RedisQuotaStore(request.getfixturevalue("redis_url"), prefix=prefix, budget_source=source)
        made.append(store)
        return store

    yield make
    for store in made:
        client = getattr(store, "client", None)
        if client is not None:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
            if keys:
                await client.delete(*keys)
        await store.close()


async def test_a_keys_own_rpm_is_counted_on_the_key(make_store) -> None:
    store = make_store(None)
    tenant = Limits(rpm=5)
    tight = KeyScope("key:1", rpm=2)
    decisions = [await store.admit("tenant:1", tenant, uuid.uuid4().hex, 0, T0, key=tight) for _ in range(3)]
    assert [d.admitted for d in decisions] == [True, True, False]
    assert decisions[2].reason == "rpm" and decisions[2].limit_requests == 2  # the key's limit refused
    assert decisions[1].limit_requests == 2 and decisions[1].remaining_requests == 0  # the tighter headers
    # Another key of the tenant still has the tenant's room (5 - 2 admitted), then the tenant's limit.
    other = [await store.admit("tenant:1", tenant, uuid.uuid4().hex, 0, T0, key=KeyScope("key:2", rpm=10))
             for _ in range(4)]
    assert [d.admitted for d in other] == [True, True, True, False]
    assert other[3].reason == "rpm" and other[3].limit_requests == 5


async def test_a_keys_tpm_is_settled_to_what_was_used(make_store) -> None:
    store = make_store(None)
    key = KeyScope("key:7", tpm=100)
    first = await store.admit("tenant:2", Limits(), uuid.uuid4().hex, 90, T0, key=key)
    assert first.admitted and first.ticket is not None
    assert not (await store.admit("tenant:2", Limits(), uuid.uuid4().hex, 20, T0, key=key)).admitted
    await store.settle(first.ticket, 10, T0 + 1)  # used 10 of the 90 reserved
    assert (await store.admit("tenant:2", Limits(), uuid.uuid4().hex, 20, T0 + 1, key=key)).admitted


async def test_a_budget_spent_before_the_store_knew_stays_spent(make_store) -> None:
    source = Spent({("tenant:3", JUNE): 250})
    store = make_store(source)
    budget = Limits(monthly_token_budget=300)
    assert (await store.admit("tenant:3", budget, uuid.uuid4().hex, 40, T0)).admitted  # 250 + 40 <= 300
    refused = await store.admit("tenant:3", budget, uuid.uuid4().hex, 40, T0)
    assert not refused.admitted and refused.reason == "budget" and not refused.should_retry
    assert source.calls == 1  # seeded once per scope and month
    # A second store (a restarted gateway, another replica) seeds from the same source.
    again = make_store(source)
    assert not (await again.admit("tenant:3", budget, uuid.uuid4().hex, 60, T0)).admitted


async def test_an_unreadable_source_refuses_budgeted_scopes_only(make_store) -> None:
    source = Spent({})
    source.fail = True
    store = make_store(source)
    with pytest.raises(QuotaUnavailable):
        await store.admit("tenant:4", Limits(monthly_token_budget=1000), uuid.uuid4().hex, 10, T0)
    assert (await store.admit("tenant:5", Limits(rpm=10), uuid.uuid4().hex, 10, T0)).admitted
    source.fail = False  # back: the next admission seeds and counts
    assert (await store.admit("tenant:4", Limits(monthly_token_budget=1000), uuid.uuid4().hex, 10, T0)).admitted


@pytest.mark.services
async def test_redis_reseeds_a_budget_after_losing_its_keys(redis_url: str) -> None:
    from gateway.quotas.redis_store import RedisQuotaStore

    prefix = f"test-quota-flush-{uuid.uuid4().hex}"
    source = Spent({("tenant:6", JUNE): 290})
    store = RedisQuotaStore(redis_url, prefix=prefix, budget_source=source)
    budget = Limits(monthly_token_budget=300)
    try:
        assert (await store.admit("tenant:6", budget, uuid.uuid4().hex, 5, T0)).admitted
        keys = [key async for key in store.client.scan_iter(match=f"{prefix}:*")]
        await store.client.delete(*keys)  # what FLUSHALL does to this scope
        refused = await store.admit("tenant:6", budget, uuid.uuid4().hex, 20, T0)
        assert not refused.admitted and refused.reason == "budget" and source.calls == 2
    finally:
        keys = [key async for key in store.client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await store.client.delete(*keys)
        await store.close()
