"""The other layer groups' pages along the prefix tree's paths (cache/kv_layout.py): which the
tree holds, how far a hit may use them, and which it gives back first.

With several groups a path is keyed by group 0's pages; each carries its position's pages of
the other groups ("companions", NO_BLOCK where the inserting sequence had given them back). A hit of P whole blocks puts the sequence's first query at position P * block_size: a group with
window W must still hold the pages of the keys that query sees, from position P * block_size - W + 1
on (a full group, window None, from position 0). A cached path may lack some of them (NO_BLOCK:
the sequence that cached it had given them back), so the hit is the longest P for which every
group's needed pages are there.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.block_pool import BlockPool
from cache.block_table import NO_BLOCK


def first_needed_block(num_blocks: int, window: int | None, block_size: int) -> int:
    """The first block a query at position num_blocks * block_size sees, in a group with `window`."""
    if window is None:
        return 0
    return max(0, num_blocks * block_size - window + 1) // block_size


def usable_blocks(companions: Sequence[tuple[int, ...]], windows: Sequence[int | None], block_size: int) -> int:
    """The longest prefix of blocks (companions[j][k]: block j's page of group k + 1, whose window is
    windows[k]) a hit may use: one whose every group holds the pages its window needs."""
    # last_missing[k][j]: the last block <= j whose group-k page is absent (-1: none).
    last_missing = []
    for k in range(len(windows)):
        missing, row = -1, []
        for j, pages in enumerate(companions):
            if pages[k] == NO_BLOCK:
                missing = j
            row.append(missing)
        last_missing.append(row)
    for num_blocks in range(len(companions), 0, -1):
        if all(last_missing[k][num_blocks - 1] < first_needed_block(num_blocks, w, block_size)
               for k, w in enumerate(windows)):
            return num_blocks
    return 0


class CompanionPages:
    """Companions of the tree's cached group-0 pages; the tree holds one pool reference on each page
    here (not NO_BLOCK), taken in `add` and given back in `pop` or `evict_left`. Empty (falsy)
    with one group."""

    def __init__(self, pool: BlockPool, windows: Sequence[int | None]) -> None:
        self.pool = pool
        self.windows = tuple(windows)  # of groups 1..
        self._pages: dict[int, tuple[int, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.windows)

    def of(self, block_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """The companions of these cached group-0 pages ([] with one group)."""
        return [self._pages[b] for b in block_ids] if self.windows else []

    def held(self, block: int) -> list[int]:
        """The pages the tree holds for this group-0 page's position (itself excluded)."""
        return [p for p in self._pages.get(block, ()) if p != NO_BLOCK]

    def usable(self, block_ids: Sequence[int]) -> int:
        """How many of these path blocks a hit may use (`usable_blocks`)."""
        return usable_blocks(self.of(block_ids), self.windows, self.pool.block_size)

    def add(self, block: int, pages: tuple[int, ...]) -> None:
        """The tree caches a group-0 page with these companions: it takes a reference on each."""
        self._pages[block] = pages
        self.pool.cache(p for p in pages if p != NO_BLOCK)

    def pop(self, block: int) -> list[int]:
        """Forget an evicted group-0 page's companions; returns those to uncache with it."""
        held = self.held(block)
        self._pages.pop(block, None)
        return held

    def evict_left(self, num_blocks: int) -> list[int]:
        """Up to num_blocks companions with only the tree's reference whose group-0 page is held: what
        a running sequence gave back as it left its window. They are uncached and become NO_BLOCK (a
        later hit stops before a window that lacks them). O(cached pages); runs when the pool is short."""
        freed: list[int] = []
        for block, pages in self._pages.items():
            if len(freed) >= num_blocks:
                break
            if self.pool.ref_count(block) == 1:
                continue  # an evictable path: its leaf goes whole, companions with it
            loose = [p for p in pages if p != NO_BLOCK and self.pool.ref_count(p) == 1]
            if loose:
                self.pool.uncache(loose)
                freed.extend(loose)
                self._pages[block] = tuple(NO_BLOCK if p in loose else p for p in pages)
        return freed
