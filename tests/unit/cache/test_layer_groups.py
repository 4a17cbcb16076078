"""Layer groups (Gemma 2/3's mixed windows): the layout, one table per group over one page pool,
prefix hits that stop where a window's pages are gone, and pages a running sequence gave back
reclaimed under pressure. Pool and tree are checked after every stage."""

from __future__ import annotations

import pytest
import torch

from cache import KVCacheManager
from cache.block_pool import OutOfBlocksError
from cache.block_table import NO_BLOCK
from cache.companions import first_needed_block, usable_blocks
from cache.grouped_table import GroupedBlockTable
from cache.kv_layout import KVLayout
from cache.kv_storage import KVStorage

FULL, W = None, 8
GEMMA3_1B = [FULL if (i + 1) % 6 == 0 else 512 for i in range(26)]  # 4 full layers, 22 sliding


def test_one_window_for_every_layer_is_one_group() -> None:
    assert KVLayout.for_windows([W] * 4) == KVLayout.single(4, W)
    assert KVLayout.for_windows([FULL] * 3) == KVLayout(3, (None,), (0, 0, 0), (0, 1, 2))


def test_mixed_windows_make_groups_as_large_as_the_rarest_window() -> None:
    layout = KVLayout.for_windows(GEMMA3_1B)
    assert layout.layers_per_page == 4 and layout.group_windows == (None,) + (512,) * 6
    assert [layout.group_of_layer[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]  # full layers: group 0
    assert [layout.slot_of_layer[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert layout.group_of_layer[:6] == (1, 1, 1, 1, 2, 0) and layout.slot_of_layer[:5] == (0, 1, 2, 3, 0)
    per_group = [[layer for layer in range(26) if layout.group_of_layer[layer] == g] for g in range(7)]
    assert [len(layers) for layers in per_group] == [4, 4, 4, 4, 4, 4, 2]  # the last sliding group is half used
    gemma2 = KVLayout.for_windows([W, FULL, W])  # alternating, full layers first in group order
    assert gemma2.group_windows == (None, W, W) and gemma2.group_of_layer == (1, 0, 2)


def test_layers_of_one_slot_share_storage_and_a_page_copy_moves_every_slot() -> None:
    layout = KVLayout.for_windows([W, FULL, W, W])  # groups: full [1], sliding [0], [2], [3]: one layer a page
    kv = KVStorage(4, num_blocks=6, block_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, layout=layout)
    assert all(k is kv.keys[0] for k in kv.keys) and KVStorage.bytes_per_block(1, 2, 1, 4, torch.float32) == 64
    kv.keys[1][3].fill_(7.0)
    kv.copy_blocks([(3, 5)])
    assert torch.equal(kv.keys[0][5], torch.full((2, 1, 4), 7.0))
    with pytest.raises(ValueError, match="layout of 4 layers"):
        KVStorage(3, 6, 2, 1, 4, torch.float32, layout=layout)


def test_a_hit_uses_the_longest_prefix_whose_windows_are_complete() -> None:
    present, gone = (1,), (NO_BLOCK,)
    assert first_needed_block(5, W, 4) == 3 and first_needed_block(1, W, 4) == 0 and first_needed_block(5, None, 4) == 0
    assert usable_blocks([present] * 5, [W], 4) == 5
    assert usable_blocks([gone, gone, gone, present, present], [W], 4) == 5  # keys 13.. are in blocks 3, 4
    assert usable_blocks([present, present, gone, present, gone], [W], 4) == 2  # 5 lacks block 4, 4 and 3 block 2
    assert usable_blocks([gone] + [present] * 4, [None], 4) == 0  # a full group needs every block


def grouped_cache(num_pages: int) -> KVCacheManager:
    return KVCacheManager(num_pages, block_size=4, layout=KVLayout.for_windows([W, FULL, W]))  # 3 groups


def test_one_table_per_group_grows_at_once_and_sliding_groups_give_pages_back() -> None:
    cache = grouped_cache(12)
    table = cache.match_and_lock("a", list(range(14))).table
    assert isinstance(table, GroupedBlockTable) and [t.window for t in table.groups] == [None, W, W]
    assert cache.try_grow(table, 14) == [] and cache.pool.num_free == 0  # 4 blocks x 3 groups
    assert cache.try_grow(table, 3) is None and table.num_tokens == 14  # no room: nothing changed
    cache.check_integrity([table])
    assert table.drop_out_of_window(14) == 2  # keys from 7 on: block 0 of both sliding groups goes
    assert [t.num_dropped for t in table.groups] == [0, 1, 1] and cache.pool.num_free == 2
    child = cache.fork(table)
    cache.check_integrity([table, child])
    with pytest.raises(OutOfBlocksError):  # 3 pages for the next block, 2 free: all or nothing
        table.append(3)
    assert table.num_tokens == 14 and [len(t.block_ids) for t in table.groups] == [4, 4, 4]
    child.truncate(12)
    cache.release(child)
    cache.check_integrity([table])
    cache.release(table)
    assert cache.pool.num_free == 12


def test_a_hit_holds_only_what_its_windows_need_and_left_pages_are_reclaimed_first() -> None:
    cache = grouped_cache(24)
    prompt = list(range(20))
    first = cache.match_and_lock("a", prompt + [99]).table
    cache.try_grow(first, 21)
    cache.commit("a", prompt, first)  # 5 blocks cached in every group
    first.drop_out_of_window(21)  # keys from 14 on: the sliding groups keep blocks 3.. (2 pages each)
    cache.check_integrity([first])

    hit = cache.match_and_lock("a", prompt + [50])  # 5 blocks: the sliding groups need blocks 3, 4 only
    assert hit.cached_len == 20
    assert [t.block_ids[:3] for t in hit.table.groups[1:]] == [[NO_BLOCK] * 3] * 2
    assert [t.held_ids for t in hit.table.groups[1:]] == [t.held_ids[:2] for t in first.groups[1:]]
    cache.check_integrity([first, hit.table])
    cache.release(hit.table)

    # The pages `first` left behind (sliding blocks 0..2, the tree's alone) go before any whole path.
    used = cache.pool.num_free
    taken = cache.pool.allocate(used + 6)
    assert cache.stats().namespaces["a"]["evicted_tokens"] == 0 and cache.peek("a", prompt + [50]) == 20
    cache.pool.release(taken)
    assert cache.peek("a", prompt[:12] + [7]) == 0  # a hit at block 3 needs sliding pages of block 1 on
    cache.check_integrity([first])
    cache.cache_and_release("a", prompt + [99], first)
    cache.check_integrity([])
    assert cache.all_free_or_evictable()


def test_a_partial_block_hit_copies_the_block_in_every_group() -> None:
    cache = grouped_cache(24)
    cached = list(range(1, 13))
    hit = cache.match_and_lock("ns", cached)
    cache.try_grow(hit.table, 12)
    cache.cache_and_release("ns", cached, hit.table)
    again = cache.match_and_lock("ns", cached[:10] + [77, 78])  # 2 whole blocks + 2 tokens of the third
    assert again.cached_len == 10 and len(again.copies) == 3
    sources = [src for src, _ in again.copies]
    assert sources[0] == cache.tree.match("ns", cached + [0]).block_ids[2]
    assert [dst for _, dst in again.copies] == [t.block_ids[2] for t in again.table.groups]
    cache.check_integrity([again.table])
    cache.release(again.table)
