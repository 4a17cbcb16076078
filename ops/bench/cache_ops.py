"""Prefix-cache operation latency: match + insert of a 2,048-token prompt, and bulk eviction.

Setup: 100k tokens cached across 1,000 prompts that share 32 system prompts (block size 16).
Prints p50/p99 of match + insert (µs) and the time to evict 10,000 blocks (ms).

    .venv/bin/python ops/bench/cache_ops.py [--trials 500]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from cache import BlockPool, BlockTable, RadixPrefixTree

BLOCK_SIZE = 16
SYSTEM_PROMPT_LEN = 64
NUM_SYSTEM_PROMPTS = 32
NUM_PROMPTS = 1000
PROMPT_LEN = 160  # 4 shared + 6 own full blocks each: ~98k cached tokens in all
LONG_PROMPT_LEN = 2048


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(49152) for _ in range(n)]


def hold_and_insert(tree: RadixPrefixTree, namespace: str, tokens: list[int]) -> tuple[float, float]:
    """One request's cache life; returns (match seconds, insert seconds)."""
    start = time.perf_counter()
    match = tree.match(namespace, tokens)
    matched_at = time.perf_counter()
    tree.lock(match.handle)
    table = BlockTable(tree.pool, match.block_ids, match.cached_len)
    table.append(len(tokens) - match.cached_len)
    insert_start = time.perf_counter()
    tree.insert(namespace, tokens, table.block_ids)
    inserted_at = time.perf_counter()
    table.release()
    return matched_at - start, inserted_at - insert_start


def percentile(samples: list[float] | tuple[float, ...], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(label: str, tree: RadixPrefixTree, prompts: list[list[int]]) -> None:
    """Run each prompt's cache life and print match + insert latency percentiles."""
    matches, inserts = zip(*(hold_and_insert(tree, "tenant", tokens) for tokens in prompts), strict=True)
    us = 1e6
    totals = [m + i for m, i in zip(matches, inserts, strict=True)]
    print(f"{label}, {len(totals)} trials: p50 {percentile(totals, 0.5) * us:.0f} µs, "
          f"p99 {percentile(totals, 0.99) * us:.0f} µs (match p50 {statistics.median(matches) * us:.0f} µs, "
          f"insert p50 {statistics.median(inserts) * us:.0f} µs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=500)
    args = parser.parse_args()
    rng = random.Random(0)
    pool = BlockPool(num_blocks=120_000, block_size=BLOCK_SIZE)
    tree = RadixPrefixTree(pool)
    systems = [random_tokens(rng, SYSTEM_PROMPT_LEN) for _ in range(NUM_SYSTEM_PROMPTS)]
    for i in range(NUM_PROMPTS):
        hold_and_insert(tree, "tenant", systems[i % NUM_SYSTEM_PROMPTS] + random_tokens(rng, PROMPT_LEN - SYSTEM_PROMPT_LEN))
    print(f"cached: {pool.num_evictable * BLOCK_SIZE:,} tokens in {pool.num_evictable:,} blocks "
          f"({NUM_PROMPTS} prompts, {NUM_SYSTEM_PROMPTS} shared system prompts)")

    new_prompts = [
        systems[i % NUM_SYSTEM_PROMPTS] + random_tokens(rng, LONG_PROMPT_LEN - SYSTEM_PROMPT_LEN)
        for i in range(args.trials)
    ]
    report(f"match + insert of a new {LONG_PROMPT_LEN}-token prompt (system prompt hit)", tree, new_prompts)
    longest = max(tree.cached_prefixes("tenant"), key=len)
    report(f"match + insert of a fully cached {len(longest) + 1}-token prompt", tree,
           [longest + [1]] * args.trials)

    tree.check_integrity()
    print(f"evictable before eviction: {pool.num_evictable:,} blocks")
    for _ in range(3):
        start = time.perf_counter()
        freed = tree.evict(10_000)
        elapsed = time.perf_counter() - start
        print(f"evict 10,000 blocks: {elapsed * 1e3:.1f} ms (freed {len(freed):,})")
    tree.check_integrity()


if __name__ == "__main__":
    main()
