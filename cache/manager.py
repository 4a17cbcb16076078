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

With a layout of several layer groups (cache/kv_layout.py) a sequence's table is a
GroupedBlockTable (one table per group, pages from the one pool) and the tree carries each
group-0 page's companions; a hit then holds only the pages its groups' windows still need.
Plain Python on ints, like the pool and the tree: no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cache.block_pool import BlockPool, OutOfBlocksError
from cache.block_table import NO_BLOCK, BlockTable
from cache.companions import first_needed_block
from cache.grouped_table import GroupedBlockTable, SequenceTable
from cache.kv_layout import KVLayout
from cache.radix_tree import MatchResult, RadixPrefixTree


@dataclass(frozen=True)
class PrefixHit:
    """A prompt matched against the tree, its blocks locked in a new table the caller now owns."""

    table: SequenceTable  # matched whole blocks (+ the partial copy's block), covering cached_len tokens
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
    def __init__(self, num_blocks: int, block_size: int, layout: KVLayout | None = None) -> None:
        """num_blocks: pages of the layout (blocks of every layer with one group)."""
        self.pool = BlockPool(num_blocks, block_size)
        self.windows = (layout or KVLayout.single(1)).group_windows  # per group; [0] is the widest
        # The tree registers itself as the pool's evictor.
        self.tree = RadixPrefixTree(self.pool, self.windows[1:])

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
        groups = self._held_pages(match)
        cached_len, copies = match.cached_len, []
        sources = [partial[0], *self._companions(partial[0])] if partial is not None else []
        if partial is not None and NO_BLOCK not in sources and self.pool.can_allocate(len(groups)):
            for ids, source, copy in zip(groups, sources, self.pool.allocate(len(groups)), strict=True):
                ids.append(copy)
                copies.append((source, copy))
            cached_len += partial[1]
        return PrefixHit(self._table(groups, cached_len), cached_len, match.cached_len // self.block_size, copies)

    def _held_pages(self, match: MatchResult) -> list[list[int]]:
        """Per group, the pages of a locked match a new table holds: all of group 0's; of the other
        groups those the first query's window needs (NO_BLOCK before), each retained here."""
        groups = [list(match.block_ids)]
        for k, window in enumerate(self.windows[1:]):
            first = first_needed_block(len(match.block_ids), window, self.block_size)
            ids = [NO_BLOCK] * first + [pages[k] for pages in match.companions[first:]]
            self.pool.retain(ids[first:])
            groups.append(ids)
        return groups

    def _companions(self, block: int) -> tuple[int, ...]:
        """A cached group-0 page's pages of the other groups (none with one group)."""
        return self.tree.companions.of([block])[0] if len(self.windows) > 1 else ()

    def _table(self, groups: list[list[int]], num_tokens: int) -> SequenceTable:
        """A sequence's table over these pages (one list per group; the caller hands over its references)."""
        tables = [BlockTable(self.pool, ids, num_tokens, w) for ids, w in zip(groups, self.windows, strict=True)]
        return tables[0] if len(tables) == 1 else GroupedBlockTable(self.pool, tables)

    def no_match(self) -> PrefixHit:
        """A new empty table, as if nothing were cached: for a sequence that must compute its whole
        prompt (it wants every prompt position's logits). It may still `commit` its blocks."""
        return PrefixHit(self._table([[] for _ in self.windows], 0), 0, 0, [])

    def count_match(self, namespace: str, num_tokens: int, cached_len: int) -> None:
        """Add a match (num_tokens looked up, the first cached_len served from whole cached blocks)
        to the namespace's hit/miss stats."""
        self.tree.count_match(namespace, num_tokens, cached_len)

    # -- growth ---------------------------------------------------------------------------------
    def try_grow(self, table: SequenceTable, num_new_tokens: int) -> list[tuple[int, int]] | None:
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

    def fork(self, table: SequenceTable) -> SequenceTable:
        """A child table sharing every block (one more reference on each)."""
        return table.fork()

    # -- the tree -------------------------------------------------------------------------------
    def commit(self, namespace: str, tokens: Sequence[int], table: SequenceTable) -> None:
        """Cache the whole blocks of `tokens` (computed, held by `table`) so that other requests
        hit them; the table keeps its references, the tree takes its own. Full blocks are never
        written again, so caching them while the sequence runs is safe."""
        first, *others = table.groups
        companions = list(zip(*(t.block_ids for t in others), strict=True)) if others else []
        self.tree.insert(namespace, tokens, first.block_ids, companions)

    def committable_blocks(self, computed_len: int, prompt_len: int) -> int:
        """Whole blocks a running sequence offers the tree: all it computed, but with sliding windows
        only its prompt's. A committed group-0 block stays in the tree while the sequence holds
        blocks below it, which would keep every generated block alive; the pages a sliding group
        gives back stay cached too, but the tree evicts them first when the pool runs short."""
        limit = computed_len if all(w is None for w in self.windows) else min(computed_len, prompt_len)
        return limit // self.block_size

    def cache_and_release(self, namespace: str, tokens: Sequence[int], table: SequenceTable) -> None:
        """Cache the whole blocks of `tokens` (what the table's sequence computed), then give back
        every reference of the table; it is empty afterwards."""
        self.commit(namespace, tokens, table)
        table.release()

    def release(self, table: SequenceTable) -> None:
        """Give back every reference of the table without caching anything."""
        table.release()

    # -- checks and figures ---------------------------------------------------------------------
    def check_integrity(self, tables: Iterable[SequenceTable]) -> None:
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
