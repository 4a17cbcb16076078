"""Block pool, radix tree and block tables: the behaviours the engine relies on."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cache import BlockPool, BlockTable, OutOfBlocksError, RadixPrefixTree
from cache.kv_storage import KVStorage, slot_mapping, slot_mapping_tensor


def make(num_blocks: int = 32, block_size: int = 4) -> tuple[BlockPool, RadixPrefixTree]:
    pool = BlockPool(num_blocks, block_size)
    return pool, RadixPrefixTree(pool)


def cache_sequence(tree: RadixPrefixTree, namespace: str, tokens: list[int]) -> int:
    """Run a sequence to completion: match, hold, allocate, insert, release."""
    match = tree.match(namespace, tokens)
    tree.lock(match.handle)
    table = BlockTable(tree.pool, match.block_ids, match.cached_len)
    table.append(len(tokens) - match.cached_len)
    already = tree.insert(namespace, tokens, table.block_ids)
    table.release()
    tree.check_integrity()
    return already


def test_match_never_covers_the_last_token_and_only_whole_blocks() -> None:
    _, tree = make()
    tokens = list(range(12))
    cache_sequence(tree, "a", tokens)
    assert tree.match("a", tokens).cached_len == 8  # 12 tokens cached, but the last must be computed
    assert tree.match("a", tokens + [99]).cached_len == 12
    assert tree.match("a", tokens[:7]).cached_len == 4
    assert tree.match("a", [0, 1, 2]).cached_len == 0


def test_split_mid_edge_keeps_both_branches() -> None:
    pool, tree = make()
    first = list(range(16))
    cache_sequence(tree, "a", first)
    second = first[:9] + [100] * 7  # diverges inside the third block
    assert cache_sequence(tree, "a", second) == 8
    assert sorted(map(len, tree.cached_prefixes("a"))) == [16, 16]
    assert tree.match("a", first + [0]).cached_len == 16
    assert tree.match("a", second + [0]).cached_len == 16
    assert pool.num_evictable == 4 + 2  # one shared 2-block edge + two 2-block branches


def test_namespaces_never_share_entries() -> None:
    _, tree = make()
    secret = list(range(20))
    cache_sequence(tree, "tenant-a", secret)
    assert tree.match("tenant-b", secret).cached_len == 0
    assert tree.match("tenant-a", secret).cached_len == 16
    assert tree.stats["tenant-b"].hit_tokens == 0 and tree.stats["tenant-b"].miss_tokens == 20
    assert tree.stats["tenant-a"].hit_tokens == 16 and tree.stats["tenant-a"].inserted_tokens == 20


def test_lru_leaves_go_first_and_parents_after_their_children() -> None:
    pool, tree = make(block_size=2)
    shared = [7, 7]
    old, mid, new = shared + [1, 1], shared + [2, 2], shared + [3, 3]
    for tokens in (old, mid, new):
        cache_sequence(tree, "a", tokens)
    tree.match("a", old + [0])  # touch `old`: now `mid` is the least recently used leaf
    mid_block = tree.match("a", mid + [0]).block_ids[-1]
    tree.match("a", new + [0])
    tree.match("a", old + [0])
    assert tree.evict(1) == [mid_block]
    assert tree.match("a", mid + [0]).cached_len == 2
    tree.evict(2)  # both remaining leaves; the shared parent now becomes a leaf
    assert tree.cached_prefixes("a") == [shared]
    assert tree.evict(5) != [] and tree.cached_prefixes("a") == []
    assert pool.num_free == pool.num_blocks
    tree.check_integrity()


def test_locked_paths_are_not_evicted_until_unlocked() -> None:
    pool, tree = make()
    tokens = list(range(12))
    cache_sequence(tree, "a", tokens)
    match = tree.match("a", tokens + [0])
    tree.lock(match.handle)
    assert pool.num_evictable == 0 and tree.evict(10) == []
    tree.check_integrity(Counter(match.block_ids))
    tree.unlock(match.handle)
    assert sorted(tree.evict(10)) == sorted(match.block_ids)


def test_exhaustion_evicts_what_it_can_then_raises_a_typed_error() -> None:
    pool, tree = make(num_blocks=4, block_size=2)
    cache_sequence(tree, "a", [1, 2, 3, 4])  # 2 evictable blocks
    held = pool.allocate(2)  # takes the 2 free ones
    assert pool.num_free == 0 and pool.num_evictable == 2
    with pytest.raises(OutOfBlocksError) as err:
        pool.allocate(3)
    assert (err.value.requested, err.value.available) == (3, 2)
    assert pool.num_free == 2 and pool.num_evictable == 0  # partial eviction stuck
    more = pool.allocate(2)
    assert len(more) == 2 and pool.num_used == 4
    tree.check_integrity(Counter(held + more))


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write() -> None:
    pool = BlockPool(16, 4)
    storage = KVStorage(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    parent = BlockTable(pool)
    parent.append(6)  # blocks: one full, one with 2 of 4 slots used
    for layer in storage.keys:
        layer[parent.block_ids[1]] = 5.0
    child = parent.fork()
    assert child.block_ids == parent.block_ids
    assert [pool.ref_count(b) for b in parent.block_ids] == [2, 2]

    copies = child.append(1)
    assert copies == [(parent.block_ids[1], child.block_ids[1])]
    storage.copy_blocks(copies)
    assert child.block_ids[0] == parent.block_ids[0]  # the full block stays shared
    assert torch.equal(storage.keys[1][child.block_ids[1]], storage.keys[1][parent.block_ids[1]])
    assert parent.append(1) == []  # the parent's block is no longer shared: no copy
    pool.check_integrity(Counter(parent.block_ids) + Counter(child.block_ids))
    child.release()
    parent.release()
    assert pool.num_free == 16


def test_slot_mapping_helpers_agree() -> None:
    blocks = [5, 2, 9]
    assert slot_mapping(blocks, 3, 6, 4) == [23, 8, 9]
    table = torch.tensor([blocks, [1, 0, 3]])
    positions = torch.tensor([[3, 4, 5], [0, 8, 11]])
    assert slot_mapping_tensor(table, positions, 4).tolist() == [[23, 8, 9], [4, 12, 15]]


def test_storage_sized_from_a_budget() -> None:
    per_block = KVStorage.bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 2
    storage = KVStorage.from_budget(30, 16, 3, 64, torch.bfloat16, budget_bytes=10 * per_block + 5)
    assert storage.num_blocks == 10 and storage.keys[0].shape == (10, 16, 3, 64)
    with pytest.raises(ValueError, match="holds no block"):
        KVStorage.from_budget(30, 16, 3, 64, torch.bfloat16, budget_bytes=100)
    assert KVStorage.from_budget(1, 16, 1, 8, torch.float32, memory_fraction=0.0001).num_blocks >= 1


def test_misuse_is_refused() -> None:
    pool, tree = make()
    with pytest.raises(ValueError, match="power of two"):
        BlockPool(4, 3)
    [block] = pool.allocate(1)
    pool.release([block])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([block])
    with pytest.raises(ValueError, match="free and cannot be retained"):
        pool.retain([block])
    with pytest.raises(ValueError, match="block ids"):
        tree.insert("a", list(range(8)), [])


def test_tree_logic_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, cache; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_match_partial_block_finds_the_longest_continuation() -> None:
    pool = BlockPool(16, block_size=4)
    tree = RadixPrefixTree(pool)
    held = pool.allocate(3)
    tree.insert("ns", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], held)
    pool.release(held)
    match = tree.match("ns", [1, 2, 3, 4, 5, 6, 99, 99, 99])
    assert match.cached_len == 4
    assert tree.match_partial_block("ns", [1, 2, 3, 4, 5, 6, 99, 99, 99], match) == (held[1], 2)
    short = tree.match("ns", [1, 2, 3, 4, 5, 6])  # the last token is never covered
    assert tree.match_partial_block("ns", [1, 2, 3, 4, 5, 6], short) == (held[1], 1)
    assert tree.match_partial_block("other", [1, 2, 3], tree.match("other", [1, 2, 3])) is None
