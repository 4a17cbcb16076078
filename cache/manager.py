"""The KV cache facade: one owner of the block pool and the radix prefix tree, offering the few
verbs a scheduler needs.

Underneath, storage and index stay separate: the pool (`block_pool.py`) is the single owner of
the free list and of one reference count per block; the tree (`radix_tree.py`) maps each
namespace's token prefixes to blocks and holds one pool reference per block it caches, which it
gives back only when the pool asks it to evict (it never frees on its own). A sequence holds its
blocks through a `BlockTable`, one reference per block; a lock is such a reference: matching a
prompt locks the matched path, so those blocks cannot be evicted while the sequence uses them.

A sequence's life through the facade:
  peek               prompt tokens the tree would serve now (a scheduling hint; changes nothing)
  match_and_lock     a new table on the matched, locked blocks (+ a copy of a partly matching block)
  no_match           a new empty table (a sequence that recomputes its whole prompt)
  count_match        count a match in the hit/miss stats (when match_and_lock was told not to)
  try_grow           room for the next tokens (copy-on-write of a shared last block included)
  fork               a child table sharing every block (parallel sampling, n > 1)
  commit             offer computed whole blocks to the tree while the sequence still runs
  cache_and_release  at the end (finish, abort, preemption): cache what it computed, give back
  release            give back without caching (an admission that did not fit)
`check_integrity(tables)` checks pool, tree and the tables' holdings agree (tests run it).
Plain Python on ints, like the pool and the tree: no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cache.block_pool import BlockPool, OutOfBlocksError
from cache.block_table import BlockTable
from cache.radix_tree import RadixPrefixTree


@dataclass(frozen=True)
class PrefixHit:
    """A prompt matched against the tree, its blocks locked in a new table the caller now owns."""

    table: BlockTable  # matched whole blocks (+ the partial copy's block), covering cached_len tokens
    cached_len: int  # tokens whose K/V the table holds: whole matched blocks + k of a partial block
    num_matched_blocks: int  # whole blocks matched in the tree (already cached there)
    copies: list[tuple[int, int]]  # (src, dst) block copy to do before the step writes (partial block)


@dataclass(frozen=True)
class CacheStats:
    block_size: int
    num_blocks: int
    num_free: int  # on the free list
    num_used: int  # held by at least one sequence
    num_evictable: int  # cached in the tree and held by nothing else
    namespaces: dict[str, dict[str, int]]  # per namespace: hit, miss, inserted and evicted tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.tree = RadixPrefixTree(self.pool)  # registers itself as the pool's evictor

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # -- admission ------------------------------------------------------------------------------
    def peek(self, namespace: str, tokens: Sequence[int]) -> int:
        """Tokens `match_and_lock` would serve from whole blocks now; no stats, no LRU touch."""
        return self.tree.peek(namespace, tokens)

    def match_and_lock(self, namespace: str, tokens: Sequence[int], count: bool = True) -> PrefixHit:
        """The longest cached prefix of `tokens` (never their last token) in a new table.

        The table holds one reference on each matched block (locked: not evictable until
        released). When the prompt goes on into part of a cached block and a block is free, that
        block is copied into one of the table's own (the tree's block stays as it is) and its
        first k tokens count as cached; the copy runs before the step writes anything, so its
        source is intact even if this very allocation evicted it.

        `count=False` leaves the namespace's hit/miss stats alone: a caller that may give the table
        back at once (the admission did not fit) counts with `count_match` once it keeps it.
        """
        match = self.tree.match(namespace, tokens, count)
        partial = self.tree.match_partial_block(namespace, tokens, match)
        self.tree.lock(match.handle)
        block_ids, cached_len, copies = list(match.block_ids), match.cached_len, []
        if partial is not None and self.pool.can_allocate(1):
            source, k = partial
            block_ids += self.pool.allocate(1)
            cached_len += k
            copies = [(source, block_ids[-1])]
        table = BlockTable(self.pool, block_ids, cached_len)
        return PrefixHit(table, cached_len, match.cached_len // self.block_size, copies)

    def no_match(self) -> PrefixHit:
        """A new empty table, as if nothing were cached: for a sequence that must compute its whole
        prompt (it wants every prompt position's logits). It may still `commit` its blocks."""
        return PrefixHit(BlockTable(self.pool, [], 0), 0, 0, [])

    def count_match(self, namespace: str, num_tokens: int, cached_len: int) -> None:
        """Add a match (num_tokens looked up, the first cached_len served from whole cached blocks)
        to the namespace's hit/miss stats."""
        self.tree.count_match(namespace, num_tokens, cached_len)

    # -- growth ---------------------------------------------------------------------------------
    def try_grow(self, table: BlockTable, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Room for num_new_tokens more tokens: the (src, dst) block copies to perform, or None (the
        table unchanged) when even eviction cannot supply the blocks.

        Trying is the only honest test: the pool's evictable count includes cached blocks that no
        sequence holds but that sit inside the tree above blocks a sequence does hold (a running
        sequence whose committed blocks continue a cached path through blocks of another's), and
        such a block can be evicted only after the sequences below it let go.
        """
        try:
            return table.append(num_new_tokens)
        except OutOfBlocksError:
            return None

    def fork(self, table: BlockTable) -> BlockTable:
        """A child table sharing every block (one more reference on each)."""
        return table.fork()

    # -- the tree -------------------------------------------------------------------------------
    def commit(self, namespace: str, tokens: Sequence[int], table: BlockTable) -> None:
        """Cache the whole blocks of `tokens` (computed, held by `table`) so that other requests
        hit them; the table keeps its references, the tree takes its own. Full blocks are never
        written again, so caching them while the sequence runs is safe."""
        self.tree.insert(namespace, tokens, table.block_ids)

    def cache_and_release(self, namespace: str, tokens: Sequence[int], table: BlockTable) -> None:
        """Cache the whole blocks of `tokens` (what the table's sequence computed), then give back
        every reference of the table; it is empty afterwards."""
        self.tree.insert(namespace, tokens, table.block_ids)
        table.release()

    def release(self, table: BlockTable) -> None:
        """Give back every reference of the table without caching anything."""
        table.release()

    # -- checks and figures ---------------------------------------------------------------------
    def check_integrity(self, tables: Iterable[BlockTable]) -> None:
        """AssertionError unless pool and tree agree and `tables` (every live table) account for
        every reference other than the tree's."""
        holders = Counter(block for table in tables for block in table.held_ids)
        self.pool.check_integrity(holders)
        self.tree.check_integrity()

    def all_free_or_evictable(self) -> bool:
        """Nothing holds a block (what remains cached can all be evicted)."""
        return self.pool.num_free + self.pool.num_evictable == self.pool.num_blocks

    def stats(self) -> CacheStats:
        pool = self.pool
        return CacheStats(
            block_size=pool.block_size, num_blocks=pool.num_blocks, num_free=pool.num_free,
            num_used=pool.num_used, num_evictable=pool.num_evictable,
            namespaces={ns: vars(stats).copy() for ns, stats in self.tree.stats.items()},
        )
