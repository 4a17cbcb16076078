"""The KV block pool: the single owner of free block ids, with a reference count per block.

Every block is in exactly one state:
- free: ref 0, on the free list;
- evictable: cached in the prefix tree and held by nothing else (ref 1, the tree's reference);
- referenced: held by at least one sequence (ref >= 1, plus 1 if also cached in the tree).

A sequence holds one reference per block in its block table (allocation gives it one; a prefix
match locked in the tree or a fork retains one more). The prefix tree holds one reference on each
block it caches, and gives it back only when told to evict. When `allocate` finds too few free
blocks it asks the evictor (the tree) for more; evicted blocks come back through `uncache`.
All per-block operations are O(1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping


class OutOfBlocksError(RuntimeError):
    """An allocation that cannot be met even after evicting every evictable block."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"need {requested} KV blocks, only {available} can be freed")
        self.requested = requested
        self.available = available


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._cached = [False] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids come out first
        self._num_evictable = 0
        self._evictor: Callable[[int], list[int]] | None = None

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self._num_evictable

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- sequences' references ----------------------------------------------------------------
    def set_evictor(self, evictor: Callable[[int], list[int]]) -> None:
        """`evictor(n)` evicts up to n evictable blocks (calling `uncache`) and returns their ids."""
        self._evictor = evictor

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free + self._num_evictable

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh block ids, each with one reference held by the caller.

        Evicts cached blocks on demand. Raises OutOfBlocksError (allocating nothing) when even
        eviction cannot make room; blocks evicted on the way stay free.
        """
        if num_blocks > len(self._free) and self._evictor is not None:
            self._evictor(num_blocks - len(self._free))
        if num_blocks > len(self._free):
            raise OutOfBlocksError(num_blocks, len(self._free) + self._num_evictable)
        ids = [self._free.pop() for _ in range(num_blocks)]
        for block_id in ids:
            self._ref[block_id] = 1
        return ids

    def retain(self, block_ids: Iterable[int]) -> None:
        """One more reference on blocks that are already held or cached."""
        for block_id in block_ids:
            ref = self._ref[block_id]
            if ref == 0:
                raise ValueError(f"block {block_id} is free and cannot be retained")
            if self._cached[block_id] and ref == 1:
                self._num_evictable -= 1
            self._ref[block_id] = ref + 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Give back one reference per id: uncached blocks reaching 0 go to the free list;
        cached blocks left with only the tree's reference become evictable."""
        for block_id in block_ids:
            ref = self._ref[block_id] - 1
            if ref < 0 or (ref == 0 and self._cached[block_id]):
                raise ValueError(f"block {block_id} released more often than it was held")
            self._ref[block_id] = ref
            if ref == 0:
                self._free.append(block_id)
            elif ref == 1 and self._cached[block_id]:
                self._num_evictable += 1

    # -- the prefix tree's reference ----------------------------------------------------------
    def cache(self, block_ids: Iterable[int]) -> None:
        """The tree takes a reference on held blocks it now caches."""
        for block_id in block_ids:
            if self._cached[block_id] or self._ref[block_id] == 0:
                raise ValueError(f"block {block_id} must be held and not yet cached to be cached")
            self._cached[block_id] = True
            self._ref[block_id] += 1

    def uncache(self, block_ids: Iterable[int]) -> None:
        """The tree drops evictable blocks: they become free."""
        for block_id in block_ids:
            if not self._cached[block_id] or self._ref[block_id] != 1:
                raise ValueError(f"block {block_id} is not evictable")
            self._cached[block_id] = False
            self._ref[block_id] = 0
            self._num_evictable -= 1
            self._free.append(block_id)

    # -- checks -------------------------------------------------------------------------------
    def check_integrity(self, holders: Mapping[int, int] | None = None) -> None:
        """Raise AssertionError unless every block is in exactly one state and counts add up.

        `holders` (block id -> number of sequences holding it), when given, must account for
        every reference other than the tree's.
        """
        free = Counter(self._free)
        if any(n > 1 for n in free.values()):
            raise AssertionError("a block id is on the free list twice")
        evictable = 0
        for block_id in range(self.num_blocks):
            ref, cached = self._ref[block_id], self._cached[block_id]
            if (block_id in free) != (ref == 0):
                raise AssertionError(f"block {block_id}: ref {ref} but on free list: {block_id in free}")
            if cached and ref < 1:
                raise AssertionError(f"cached block {block_id} has no tree reference")
            evictable += cached and ref == 1
            if holders is not None and ref - cached != holders.get(block_id, 0):
                raise AssertionError(
                    f"block {block_id}: {ref - cached} sequence references, {holders.get(block_id, 0)} holders"
                )
        if evictable != self._num_evictable:
            raise AssertionError(f"evictable count {self._num_evictable} != actual {evictable}")
