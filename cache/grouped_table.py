"""A sequence's block tables when its model's layers form several groups (cache/kv_layout.py).

`groups` holds one BlockTable per group, in group order (each with its group's window). Every
group covers the same tokens; each keeps its own pages and gives back those that left its own
window. The verbs that change the token count act on all groups at once, and
`append` allocates every group's new pages in one pool call, so it fails (changing nothing) or
succeeds for all. Ownership: the table holds one pool reference per page in any group.
"""

from __future__ import annotations

from cache.block_pool import BlockPool
from cache.block_table import BlockTable


class GroupedBlockTable:
    def __init__(self, pool: BlockPool, tables: list[BlockTable]) -> None:
        """Adopt `tables` (one per group, group 0 first, all covering the same tokens)."""
        if any(t.num_tokens != tables[0].num_tokens or t.pool is not pool for t in tables):
            raise ValueError("a sequence's group tables must cover the same tokens in one pool")
        self.pool = pool
        self.groups = tables

    @property
    def num_tokens(self) -> int:
        return self.groups[0].num_tokens

    @property
    def held_ids(self) -> list[int]:
        return [block for table in self.groups for block in table.held_ids]

    def blocks_needed(self, num_new_tokens: int) -> int:
        return sum(table.blocks_needed(num_new_tokens) for table in self.groups)

    def append(self, num_new_tokens: int) -> list[tuple[int, int]]:
        """Room for num_new_tokens more tokens in every group: one allocation (OutOfBlocksError
        leaves every group unchanged); returns the (src, dst) page copies to perform."""
        needed = [table.blocks_needed(num_new_tokens) for table in self.groups]
        fresh = self.pool.allocate(sum(needed)) if sum(needed) else []
        copies: list[tuple[int, int]] = []
        for table, n in zip(self.groups, needed, strict=True):
            share, fresh = fresh[:n], fresh[n:]
            copies += table.append_with(num_new_tokens, share)
        return copies

    def truncate(self, num_tokens: int) -> None:
        for table in self.groups:
            table.truncate(num_tokens)

    def drop_out_of_window(self, computed_len: int) -> int:
        return sum(table.drop_out_of_window(computed_len) for table in self.groups)

    def fork(self) -> GroupedBlockTable:
        return GroupedBlockTable(self.pool, [table.fork() for table in self.groups])

    def release(self) -> None:
        for table in self.groups:
            table.release()


SequenceTable = BlockTable | GroupedBlockTable
"""What a sequence holds its KV through: one table, or one per layer group."""
