"""One suite for both quota stores: the in-process one and Redis (skipped when Redis is absent)."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
import pytest_asyncio

from gateway.quotas.local import LocalQuotaStore
from gateway.quotas.store import Decision, Limits, QuotaStore, Ticket, format_duration

T0 = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC: a whole second, far from a month boundary


@pytest_asyncio.fixture(params=["local", pytest.param("redis", marks=pytest.mark.services)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    if request.param == "local":
        local = LocalQuotaStore(lease_s=600)
        yield local
        await local.close()
        return
    from gateway.quotas.redis_store import RedisQuotaStore

    prefix = f"test-quotas-{uuid.uuid4().hex}"  # unique per test, deleted afterwards
    remote = RedisQuotaStore(request.getfixturevalue("redis_url"), prefix=prefix, lease_s=600)
    try:
        yield remote
    finally:
        keys = [key async for key in remote.client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await remote.client.delete(*keys)
        await remote.close()


async def admit(store: QuotaStore, limits: Limits, reserve: int = 0, now: float = T0, scope: str = "t:1") -> Decision:
    return await store.admit(scope, limits, uuid.uuid4().hex, reserve, now)


def ticket_of(decision: Decision) -> Ticket:
    if decision.ticket is None:
        raise AssertionError(f"expected an admission, got {decision}")
    return decision.ticket


@pytest.mark.asyncio
async def test_a_burst_of_400_at_rpm_100_admits_exactly_100(store: QuotaStore) -> None:
    limits = Limits(rpm=100)
    decisions = await asyncio.gather(*(admit(store, limits, now=T0 + i / 1000) for i in range(400)))
    assert sum(d.admitted for d in decisions) == 100
    refused = [d for d in decisions if not d.admitted]
    assert all(d.reason == "rpm" and d.should_retry and d.remaining_requests == 0 for d in refused)
    # Nothing more until the admitted second leaves the window, 60 s later.
    assert not (await admit(store, limits, now=T0 + 59.9)).admitted
    assert (await admit(store, limits, now=T0 + 60.0)).admitted


@pytest.mark.asyncio
async def test_the_window_slides_one_second_bucket_at_a_time(store: QuotaStore) -> None:
    limits = Limits(rpm=3)
    for offset in (0.2, 10.5, 20.9):
        assert (await admit(store, limits, now=T0 + offset)).admitted
    refused = await admit(store, limits, now=T0 + 30.25)
    assert (refused.admitted, refused.reason, refused.retry_after_s) == (False, "rpm", pytest.approx(29.75))
    assert refused.reset_requests_s == pytest.approx(49.75)  # the newest request (second T0+20) leaves then
    assert (await admit(store, limits, now=T0 + 60.0)).admitted  # the second T0+0 has left
    assert not (await admit(store, limits, now=T0 + 69.99)).admitted
    assert (await admit(store, limits, now=T0 + 70.0)).admitted


@pytest.mark.asyncio
async def test_tpm_reserves_then_settles_lower_or_higher(store: QuotaStore) -> None:
    limits = Limits(tpm=1000)
    first = await admit(store, limits, reserve=600)
    assert first.remaining_tokens == 400 and first.limit_tokens == 1000
    refused = await admit(store, limits, reserve=600, now=T0 + 1)
    assert (refused.reason, refused.should_retry, refused.retry_after_s) == ("tpm", True, pytest.approx(59))
    await store.settle(ticket_of(first), 100, now=T0 + 2)  # used less: 500 tokens come back
    second = await admit(store, limits, reserve=600, now=T0 + 3)
    assert second.admitted and second.remaining_tokens == 300
    await store.settle(ticket_of(second), 850, now=T0 + 4)  # used more than reserved: charged
    assert (await admit(store, limits, reserve=51, now=T0 + 5)).reason == "tpm"
    assert (await admit(store, limits, reserve=50, now=T0 + 5)).remaining_tokens == 0


@pytest.mark.asyncio
async def test_an_excess_settled_after_the_bucket_left_the_window_charges_the_current_second(store: QuotaStore) -> None:
    limits = Limits(tpm=1000)
    slow = ticket_of(await admit(store, limits, reserve=100))
    await store.settle(slow, 700, now=T0 + 90)  # 600 over the reservation, counted from now
    assert (await admit(store, limits, reserve=400, now=T0 + 91)).remaining_tokens == 0
    assert (await admit(store, limits, reserve=1, now=T0 + 92)).reason == "tpm"


@pytest.mark.asyncio
async def test_a_reserve_above_tpm_can_never_be_admitted(store: QuotaStore) -> None:
    decision = await admit(store, Limits(rpm=10, tpm=1000), reserve=1001)
    assert (decision.admitted, decision.reason, decision.should_retry, decision.retry_after_s) == (
        False, "tpm", False, None)
    assert decision.headers()["x-should-retry"] == "false" and "retry-after" not in decision.headers()
    assert decision.error_type == "rate_limit_error"
    assert (await admit(store, Limits(rpm=10, tpm=1000), reserve=1000)).admitted  # nothing was charged


@pytest.mark.asyncio
async def test_concurrency_is_capped_and_settle_frees_the_slot(store: QuotaStore) -> None:
    limits = Limits(max_concurrent=2)
    a, b = [ticket_of(await admit(store, limits)) for _ in range(2)]
    assert a.holds_slot
    refused = await admit(store, limits)
    assert (refused.reason, refused.should_retry, refused.retry_after_s) == ("concurrency", True, 1.0)
    await store.settle(a, 0, now=T0 + 1)
    assert (await admit(store, limits, now=T0 + 1)).admitted
    assert not (await admit(store, limits, now=T0 + 1)).admitted
    await store.settle(b, 0, now=T0 + 2)
    assert (await admit(store, limits, now=T0 + 2)).admitted


@pytest.mark.asyncio
async def test_at_most_max_concurrent_requests_run_at_once(store: QuotaStore) -> None:
    limits, running, peak, done = Limits(max_concurrent=8), 0, 0, 0

    async def request() -> None:
        nonlocal running, peak, done
        while True:
            decision = await store.admit("t:8", limits, uuid.uuid4().hex, 0)
            if decision.admitted:
                break
            await asyncio.sleep(0.001)
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1  # before settling: the slot is only given back after the work stopped
        await store.settle(ticket_of(decision), 0)
        done += 1

    await asyncio.gather(*(request() for _ in range(40)))
    assert (peak, done) == (8, 40)


@pytest.mark.asyncio
async def test_a_leaked_slot_frees_itself_when_its_lease_expires(store: QuotaStore) -> None:
    limits = Limits(max_concurrent=1)
    assert (await admit(store, limits)).admitted  # never settled: its gateway crashed
    assert not (await admit(store, limits, now=T0 + 599)).admitted
    assert (await admit(store, limits, now=T0 + 600)).admitted


@pytest.mark.asyncio
async def test_the_monthly_budget_reserves_settles_and_rolls_over(store: QuotaStore) -> None:
    limits = Limits(monthly_token_budget=1000)
    end_of_january = datetime(2026, 1, 31, 23, 59, 30, tzinfo=UTC).timestamp()
    first = ticket_of(await admit(store, limits, reserve=800, now=end_of_january))
    assert first.month == 202601
    gone = await admit(store, limits, reserve=300, now=end_of_january + 1)
    assert (gone.reason, gone.should_retry, gone.retry_after_s, gone.error_type) == (
        "budget", False, None, "insufficient_quota")
    assert gone.headers() == {"x-should-retry": "false"}
    await store.settle(first, 500, now=end_of_january + 2)  # 300 of the 800 come back: 500 spent
    second = ticket_of(await admit(store, limits, reserve=400, now=end_of_january + 3))  # 900
    assert not (await admit(store, limits, reserve=101, now=end_of_january + 4)).admitted
    third = ticket_of(await admit(store, limits, reserve=100, now=end_of_january + 5))  # 1000
    await store.settle(third, 150, now=end_of_january + 6)  # 50 more than reserved: 1050
    assert not (await admit(store, limits, reserve=0, now=end_of_january + 7)).admitted
    february = ticket_of(await admit(store, limits, reserve=1000, now=end_of_january + 31))
    assert february.month == 202602
    # A January ticket settled in February corrects January (1050 - 300 = 750), not February.
    await store.settle(second, 100, now=end_of_january + 40)
    assert not (await admit(store, limits, reserve=1, now=end_of_january + 41)).admitted
    assert not (await admit(store, limits, reserve=251, now=end_of_january - 86400)).admitted
    assert (await admit(store, limits, reserve=250, now=end_of_january - 86400)).admitted


@pytest.mark.asyncio
async def test_a_budget_only_admission_charges_the_budget_and_nothing_else(store: QuotaStore) -> None:
    """A batch line: the tenant's month budget governs it, its rpm / tpm / concurrency do not."""
    limits = Limits(rpm=1, tpm=100, max_concurrent=1, monthly_token_budget=1000)
    line = await store.admit("t:1", Limits(monthly_token_budget=1000), "line-1", 600, T0, budget_only=True)
    line_ticket = ticket_of(line)
    assert line_ticket.budget_only and not line_ticket.holds_slot
    assert line.headers() == {}  # no interactive limit applies to it: no x-ratelimit headers
    interactive = ticket_of(await admit(store, limits, reserve=90))  # the line took no request, token or slot
    assert interactive.second == math.floor(T0)
    assert (await admit(store, Limits(monthly_token_budget=1000), reserve=311)).reason == "budget"  # 600 + 90
    await store.settle(line_ticket, 200, now=T0 + 1)  # 400 of the line's 600 come back: 290 spent
    assert (await admit(store, Limits(tpm=100, monthly_token_budget=1000), reserve=11)).reason == "tpm"  # 90 + 11
    refused = await store.admit("t:1", Limits(monthly_token_budget=1000), "line-2", 711, T0 + 2, budget_only=True)
    assert (refused.reason, refused.should_retry, refused.error_type) == ("budget", False, "insufficient_quota")
    assert (await store.admit("t:1", Limits(monthly_token_budget=1000), "line-3", 710, T0 + 2,
                              budget_only=True)).admitted


@pytest.mark.asyncio
async def test_a_refused_admission_charges_nothing(store: QuotaStore) -> None:
    limits = Limits(rpm=2, tpm=100, max_concurrent=5, monthly_token_budget=10_000)
    assert (await admit(store, limits, reserve=60)).admitted
    for _ in range(5):
        assert (await admit(store, limits, reserve=60)).reason == "tpm"  # rpm and slots not charged
    assert (await admit(store, limits, reserve=40)).remaining_requests == 0


@pytest.mark.asyncio
async def test_headers_have_openai_names_and_values(store: QuotaStore) -> None:
    limits = Limits(rpm=2, tpm=1000)
    ok = await admit(store, limits, reserve=300, now=T0 + 0.25)
    assert ok.headers() == {
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "59.75s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "700",
        "x-ratelimit-reset-tokens": "59.75s",
    }
    await admit(store, limits, reserve=300, now=T0 + 30)
    refused = await admit(store, limits, reserve=300, now=T0 + 59.98)
    assert refused.headers() == {
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "30.02s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "400",
        "x-ratelimit-reset-tokens": "30.02s",
        "retry-after": "1",  # the first request leaves the window in 20 ms
    }
    assert refused.retry_after_s == pytest.approx(0.02)
    unlimited = await admit(store, Limits(max_concurrent=3), scope="t:unlimited")
    assert unlimited.admitted and unlimited.headers() == {}


@pytest.mark.asyncio
async def test_scopes_are_isolated(store: QuotaStore) -> None:
    limits = Limits(rpm=1, max_concurrent=1)
    assert (await admit(store, limits, scope="t:1")).admitted
    assert (await admit(store, limits, scope="t:1/k:7")).admitted
    assert (await admit(store, limits, scope="t:2")).admitted
    assert not (await admit(store, limits, scope="t:1")).admitted


@pytest.mark.asyncio
async def test_server_time_is_used_without_now(store: QuotaStore) -> None:
    limits = Limits(rpm=1)
    first = await store.admit("t:clock", limits, "a", 0)
    assert first.admitted and 0 < (first.reset_requests_s or 0) <= 60
    assert not (await store.admit("t:clock", limits, "b", 0)).admitted


@pytest.mark.asyncio
async def test_braces_in_a_scope_are_refused(store: QuotaStore) -> None:
    with pytest.raises(ValueError):
        await store.admit("t:{1}", Limits(), "a", 0)


def test_durations_use_openais_format() -> None:
    assert [format_duration(s) for s in (0, 0.02, 0.0201, 1, 6.5, 59.999, 360, 3600, 3661.5)] == [
        "0s", "20ms", "21ms", "1s", "6.5s", "59.999s", "6m0s", "1h0m0s", "1h1m1.5s"]


def test_limits_reject_negative_values() -> None:
    with pytest.raises(ValueError):
        Limits(rpm=-1)


@pytest.mark.asyncio
async def test_redis_callers_beyond_the_pool_wait_then_count_redis_as_unreachable() -> None:
    """With every connection busy (here: a server that never answers), the next caller queues for
    `pool_timeout_s`, then gets a connection error: the failover store's cue to apply its policy."""
    from gateway.quotas.redis_store import CONNECTION_ERRORS, RedisQuotaStore

    accepted: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisQuotaStore(f"redis://127.0.0.1:{port}/0", timeout_s=5.0, max_connections=1, pool_timeout_s=0.2)
    limits = Limits(rpm=10, tpm=None, max_concurrent=None, monthly_token_budget=None)
    try:
        stuck = asyncio.ensure_future(store.admit("t:1", limits, "held", 0))  # holds the only connection
        await asyncio.sleep(0.1)
        started = asyncio.get_running_loop().time()
        with pytest.raises(CONNECTION_ERRORS):
            await store.admit("t:1", limits, "queued", 0)
        waited = asyncio.get_running_loop().time() - started
        assert 0.15 <= waited < 2.0  # the queue's timeout, not the 5 s socket timeout
        assert len(accepted) == 1  # the queued caller never opened a second connection
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
    finally:
        await store.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
