"""How much of a cached path a prefix hit may use when layer groups give pages back (cache/kv_layout.py).

A hit of P whole blocks puts the sequence's first query at position P * block_size: a group with
window W must still hold the pages of the keys that query sees, from position P * block_size - W + 1
on (a full group, window None, from position 0). A cached path may lack some of them (NO_BLOCK:
the sequence that cached it had given them back), so the hit is the longest P for which every
group's needed pages are there.
"""

from __future__ import annotations

from collections.abc import Sequence

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
