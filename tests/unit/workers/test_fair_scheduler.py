"""The scheduler's tenant fairness (VTC, issue 25) on synthetic arrivals, without a model: each step
schedules, "computes" (update) and samples token 1 for every sampling sequence, finishing it at
max_tokens. The same workloads under `fcfs` show what the checks would catch."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest

from cache.manager import KVCacheManager
from workers.engine.fairness import W_IN, W_OUT
from workers.engine.request import FinishReason, Priority, Sequence
from workers.engine.scheduler import Scheduler
from workers.wire.sampling import SamplingParams

_tokens = itertools.count(1000)  # every prompt unique: no prefix sharing between requests


def request(tenant: str, prompt_len: int, max_tokens: int, weight: float = 1.0,
            priority: Priority = Priority.INTERACTIVE) -> Sequence:
    prompt = [next(_tokens) for _ in range(prompt_len)]
    return Sequence(f"{tenant}-{prompt[0]}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    tenant, priority, weight=weight)


def step(sched: Scheduler) -> list[Sequence]:
    """One engine step without a model; returns the sequences admitted by it."""
    waiting_before = set(sched.waiting)
    batch = sched.schedule()
    sched.take_finished()
    admitted = [s for s in batch.seqs if s in waiting_before]
    for seq in batch.seqs:  # the runner's precondition: every scheduled sequence holds its blocks
        assert seq.block_table is not None
    if batch.seqs:
        for seq in sched.update(batch).sampling:
            seq.output_ids.append(1)
            if seq.output_len >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
    sched.check_integrity()
    return admitted


def keep_backlogged(sched: Scheduler, tenant: str, make: Callable[[], Sequence], depth: int = 4) -> None:
    while sum(s.namespace == tenant for s in sched.waiting) < depth:
        sched.add(make())


def scheduler(policy: str, num_blocks: int = 64, block_size: int = 8, max_batch_tokens: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_batch_tokens=max_batch_tokens, policy=policy)


def vtc_bound(sched: Scheduler, longest_prompt: int) -> float:
    """The paper's bound on the weighted service gap of two backlogged tenants:
    2 * max(W_IN * L_in, W_OUT * M), M the most tokens the running batch can hold."""
    capacity = sched.cache.pool.num_blocks * sched.cache.block_size
    return 2 * max(W_IN * longest_prompt, W_OUT * capacity)


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_backlogged_tenants_with_different_sizes_get_service_within_the_bound(policy: str) -> None:
    sched = scheduler(policy)
    big = lambda: request("big", 96, 48)  # noqa: E731
    small = lambda: request("small", 8, 4)  # noqa: E731
    for _ in range(40):  # the big tenant floods first
        sched.add(big())
    keep_backlogged(sched, "small", small)
    gaps = []
    for _ in range(1500):
        keep_backlogged(sched, "big", big)
        keep_backlogged(sched, "small", small)
        step(sched)
        gaps.append(abs(sched.vtc.weighted_service("big") - sched.vtc.weighted_service("small")))
    total = sched.vtc.weighted_service("big") + sched.vtc.weighted_service("small")
    bound = vtc_bound(sched, 96)
    assert total > 10 * bound  # long enough for the bound to mean something
    if policy == "fair":
        assert max(gaps) <= bound
    else:  # first come, first served: the flood takes the engine and the gap only grows
        assert gaps[-1] > 4 * bound


def test_weights_two_to_one_give_service_two_to_one() -> None:
    sched = scheduler("fair")
    heavy = lambda: request("heavy", 24, 16, weight=2.0)  # noqa: E731
    light = lambda: request("light", 24, 16, weight=1.0)  # noqa: E731
    for _ in range(2000):
        keep_backlogged(sched, "heavy", heavy)
        keep_backlogged(sched, "light", light)
        step(sched)
    raw = {t: s.input_tokens * W_IN + s.output_tokens * W_OUT for t, s in sched.vtc.tenants.items()}
    assert raw["heavy"] / raw["light"] == pytest.approx(2.0, rel=0.05)
    gap = abs(sched.vtc.weighted_service("heavy") - sched.vtc.weighted_service("light"))
    assert gap <= vtc_bound(sched, 24)


def test_a_newly_arriving_tenant_is_served_next_but_banks_no_idle_time() -> None:
    sched = scheduler("fair")
    old = lambda: request("old", 32, 16)  # noqa: E731
    new = lambda: request("new", 32, 16)  # noqa: E731
    for _ in range(800):  # "old" alone, for a long while
        keep_backlogged(sched, "old", old)
        step(sched)
    old_before = sched.vtc.weighted_service("old")
    keep_backlogged(sched, "new", new)
    assert sched.vtc.counter("new") == sched.vtc.counter("old")  # lifted to the backlog's smallest
    admitted: list[Sequence] = []
    while not admitted:  # the first admission after its arrival is the newcomer's
        keep_backlogged(sched, "old", old)
        admitted = step(sched)
    assert admitted[0].namespace == "new"
    for _ in range(800):
        keep_backlogged(sched, "old", old)
        keep_backlogged(sched, "new", new)
        step(sched)
    old_since = sched.vtc.weighted_service("old") - old_before
    new_since = sched.vtc.weighted_service("new")
    # no catch-up burst: from its arrival on, the newcomer gets an equal share, not old's past service
    assert old_before > 4 * vtc_bound(sched, 32)
    assert abs(new_since - old_since) <= vtc_bound(sched, 32)


def test_aging_lifts_a_batch_request_over_interactive_work_without_jumping_tenants() -> None:
    sched = scheduler("fair")
    flood = lambda: request("flood", 8, 64)  # noqa: E731
    late = request("late", 8, 4, priority=Priority.BATCH)
    sched.add(late)
    for _ in range(20):
        keep_backlogged(sched, "flood", flood)
        step(sched)
    # batch sits out while interactive work runs, though its tenant is the one furthest behind
    assert late.block_table is None and late.output_len == 0
    assert sched.vtc.counter("late") < sched.vtc.counter("flood")
    late.arrival_time = time.monotonic() - sched.max_wait_s - 1  # it has now waited past max_wait_s
    admitted: list[Sequence] = []
    for _ in range(200):
        keep_backlogged(sched, "flood", flood)
        admitted += step(sched)
        if late in admitted:
            break
    assert admitted[0] is late  # no flood request was admitted before it


def test_aged_requests_of_a_flood_do_not_turn_fair_back_into_first_come_first_served() -> None:
    sched = Scheduler(KVCacheManager(64, 8), max_batch_tokens=64, policy="fair", max_wait_s=0.0)  # all aged
    big = lambda: request("big", 96, 48)  # noqa: E731
    small = lambda: request("small", 8, 4)  # noqa: E731
    for _ in range(40):
        sched.add(big())
    for _ in range(1500):
        keep_backlogged(sched, "big", big)
        keep_backlogged(sched, "small", small)
        step(sched)
    gap = abs(sched.vtc.weighted_service("big") - sched.vtc.weighted_service("small"))
    assert gap <= vtc_bound(sched, 96)


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_request_that_does_not_fit_holds_back_only_its_own_tenant(policy: str) -> None:
    sched = scheduler(policy, num_blocks=16, block_size=8, max_batch_tokens=256)
    runner = request("a", 64, 40)  # 8 blocks, running
    sched.add(runner)
    assert step(sched) == [runner]
    huge = request("a", 72, 4)  # 9 blocks: does not fit the 7-8 left until the runner ends
    small = request("b", 8, 4)
    sched.vtc.charge("b", input_tokens=1000)  # b is ahead: a's huge request is offered first
    sched.add(huge)
    sched.add(small)
    admitted = step(sched)
    if policy == "fair":
        assert admitted == [small]
    else:  # fcfs: the head of the queue holds everyone back
        assert admitted == []


def test_prefix_cache_stats_count_each_admission_once_under_memory_pressure() -> None:
    sched = scheduler("fcfs", num_blocks=8, block_size=8, max_batch_tokens=256)
    seqs = [request("t", 40, 8) for _ in range(3)]  # 6 blocks at the end each: one at a time
    for seq in seqs:
        sched.add(seq)
    steps = 0
    while sched.has_work():
        step(sched)
        steps += 1
    stats = sched.cache.stats().namespaces["t"]
    assert steps >= 3 * 8 and sched.preemptions == 0  # the others' admissions failed on many steps
    assert stats["hit_tokens"] + stats["miss_tokens"] == sum(s.prompt_len for s in seqs)


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_preemption_never_takes_a_sequence_already_in_the_steps_batch(policy: str) -> None:
    """An aged batch sequence runs beside an interactive one; the interactive one needs a block
    when none is free. The batch one is the preferred victim but is already in the batch."""
    sched = scheduler(policy, num_blocks=4, block_size=4, max_batch_tokens=64)
    aged = request("batch-tenant", 6, 20, priority=Priority.BATCH)
    aged.arrival_time = time.monotonic() - sched.max_wait_s - 1
    interactive = request("chat-tenant", 7, 20)
    sched.add(aged)
    sched.add(interactive)
    assert step(sched) == [aged, interactive]  # 2 blocks each: the pool is full
    step(sched)  # both still within their 2 blocks
    batch = sched.schedule()  # aged: 8th token, no new block; interactive: 9th token, needs a 3rd
    assert aged in batch.seqs and aged.block_table is not None
    assert interactive not in batch.seqs and interactive in sched.waiting  # it gave way itself
    assert sched.preemptions == 1
    sched.check_integrity()


def test_preemption_takes_from_the_tenant_furthest_ahead() -> None:
    sched = scheduler("fair", num_blocks=6, block_size=4, max_batch_tokens=64)
    ahead = request("ahead", 7, 20)
    behind = request("behind", 7, 20)
    third = request("third", 7, 20)
    for seq in (ahead, behind, third):
        sched.add(seq)
    sched.vtc.charge("ahead", input_tokens=500)
    step(sched)
    step(sched)  # all three hold 2 blocks; each needs a third on the next step
    step(sched)
    assert ahead in sched.waiting and behind.block_table is not None and third.block_table is not None


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_tenant_cap_keeps_a_flood_to_its_share_of_running_sequences(policy: str) -> None:
    sched = Scheduler(KVCacheManager(256, 8), max_batch_tokens=512, policy=policy, max_running_per_tenant=3)
    for _ in range(10):
        sched.add(request("flood", 8, 50))
    step(sched)
    assert sum(s.namespace == "flood" for s in sched.running) == 3  # 7 wait though blocks and budget are free
    victim = request("victim", 8, 2)
    sched.add(victim)
    assert step(sched) == [victim]
    for _ in range(5):
        step(sched)
        assert sum(s.namespace == "flood" for s in sched.running) <= 3


def test_without_a_cap_the_same_flood_fills_the_step() -> None:
    sched = Scheduler(KVCacheManager(256, 8), max_batch_tokens=512, policy="fair")
    for _ in range(10):
        sched.add(request("flood", 8, 50))
    step(sched)
    assert sum(s.namespace == "flood" for s in sched.running) == 10
