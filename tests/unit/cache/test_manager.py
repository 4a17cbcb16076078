"""The cache facade: a sequence's life through its verbs, with pool and tree checked at each stage."""

from __future__ import annotations

from cache import KVCacheManager
from cache.block_table import NO_BLOCK


def test_a_sequence_commits_while_running_and_a_second_one_hits_its_blocks() -> None:
    cache = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(10))
    first = cache.match_and_lock("a", tokens)
    assert (first.cached_len, first.num_matched_blocks, first.copies) == (0, 0, [])
    assert cache.try_grow(first.table, 10) == [] and len(first.table.block_ids) == 3
    cache.commit("a", tokens[:8], first.table)  # two whole blocks computed so far
    cache.check_integrity([first.table])
    assert cache.peek("a", tokens + [10]) == 8

    second = cache.match_and_lock("a", tokens[:8] + [50, 51, 52])
    assert (second.cached_len, second.num_matched_blocks) == (8, 2)
    assert second.table.block_ids == first.table.block_ids[:2]  # locked: shared, not evictable
    cache.check_integrity([first.table, second.table])
    assert cache.stats().num_evictable == 0

    cache.cache_and_release("a", tokens, first.table)
    cache.cache_and_release("a", tokens[:8], second.table)
    cache.check_integrity([])
    assert cache.all_free_or_evictable()
    stats = cache.stats()
    assert (stats.num_used, stats.num_evictable, stats.num_free) == (0, 2, 14)
    assert stats.namespaces["a"]["hit_tokens"] == 8 and stats.namespaces["a"]["inserted_tokens"] == 8


def test_a_prompt_going_on_into_part_of_a_cached_block_gets_a_copy_of_it() -> None:
    cache = KVCacheManager(num_blocks=16, block_size=4)
    cached = list(range(1, 13))
    hit = cache.match_and_lock("ns", cached)
    assert cache.try_grow(hit.table, len(cached)) == []
    cached_blocks = list(hit.table.block_ids)
    cache.cache_and_release("ns", cached, hit.table)

    hit = cache.match_and_lock("ns", [1, 2, 3, 4, 5, 6, 99, 99, 99])
    assert (hit.cached_len, hit.num_matched_blocks) == (6, 1)  # 4 in a whole block + 2 of the next
    assert hit.copies == [(cached_blocks[1], hit.table.block_ids[1])]
    assert hit.table.num_tokens == 6
    cache.check_integrity([hit.table])
    cache.release(hit.table)
    cache.check_integrity([])


def test_growth_is_refused_without_room_and_a_release_caches_nothing() -> None:
    cache = KVCacheManager(num_blocks=2, block_size=4)
    hit = cache.match_and_lock("a", list(range(20)))
    assert cache.try_grow(hit.table, 20) is None and hit.table.block_ids == []  # unchanged
    assert cache.try_grow(hit.table, 8) == []
    child = cache.fork(hit.table)
    assert child.block_ids == hit.table.block_ids
    cache.check_integrity([hit.table, child])
    cache.release(child)
    cache.release(hit.table)
    assert cache.stats().num_free == 2 and cache.peek("a", list(range(20))) == 0
    cache.check_integrity([])


def test_growth_is_refused_when_the_only_evictable_block_sits_above_a_held_one() -> None:
    """A second sequence with the same tokens copies the cached path's partly matched block, then
    commits its own blocks below that path's block: the block is cached and held by no sequence
    (counted evictable) but not a leaf, so eviction cannot take it. Growth says no, never raises."""
    cache = KVCacheManager(num_blocks=5, block_size=4)
    tokens = list(range(12))
    first = cache.match_and_lock("a", tokens)
    assert cache.try_grow(first.table, 12) == []
    cache.cache_and_release("a", tokens, first.table)  # three cached blocks, held by the tree only

    second = cache.match_and_lock("a", tokens)  # two whole blocks + a copy of the third
    assert (second.num_matched_blocks, len(second.copies)) == (2, 1)
    longer = tokens + [40, 41, 42, 43]
    assert cache.try_grow(second.table, len(longer) - second.table.num_tokens) == []
    cache.commit("a", longer, second.table)  # its fourth block goes below the first's third
    cache.check_integrity([second.table])
    stats = cache.stats()
    assert (stats.num_free, stats.num_evictable) == (0, 1)  # counted evictable...
    assert cache.try_grow(second.table, 4) is None  # ...but not evictable while the second holds below it
    assert len(second.table.block_ids) == 4
    cache.check_integrity([second.table])
    cache.cache_and_release("a", longer, second.table)
    cache.check_integrity([])
    assert cache.all_free_or_evictable()


def test_blocks_that_left_a_sliding_window_go_back_and_the_path_stops_there() -> None:
    cache = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(14))
    table = cache.match_and_lock("a", tokens).table
    cache.try_grow(table, 14)  # 4 blocks, the last one partly filled
    cache.commit("a", tokens[:4], table)  # the prompt's first block is cached; the rest is not
    first, second, _, last = table.block_ids
    assert table.drop_before(13) == 3  # keys from 13 on: only the block holding 12..15 stays
    assert table.block_ids == [NO_BLOCK] * 3 + [last] and table.held_ids == [last]
    assert cache.pool.ref_count(first) == 1 and cache.pool.ref_count(second) == 0  # tree's / free
    assert table.drop_before(14) == 0  # never the block being written
    cache.check_integrity([table])

    child = cache.fork(table)  # shares the held block and the dropped slots
    assert child.block_ids == table.block_ids and cache.pool.ref_count(last) == 2
    child.truncate(12)  # a rejected draft: the held block goes, the dropped slots hold nothing to give
    assert child.block_ids == [NO_BLOCK] * 3 and child.held_ids == [] and cache.pool.ref_count(last) == 1
    cache.release(child)
    cache.try_grow(table, 4)  # grows past the dropped slots as usual
    assert len(table.block_ids) == 5 and table.num_dropped == 3
    cache.check_integrity([table])

    cache.cache_and_release("a", tokens + [14, 15, 16, 17], table)  # the path breaks at block 1
    cache.check_integrity([])
    assert cache.peek("a", tokens) == 4 and cache.all_free_or_evictable()
    assert cache.stats().num_free == 7
